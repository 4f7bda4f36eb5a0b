"""Running a job: checkpoints, preemption, the run guard, logs, profiling and the exit."""
