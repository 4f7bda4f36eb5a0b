"""Planning a job before it waits in a queue: will it fit, how fast, what breaks at scale.

  planning/layouts.py      the layouts a config can run in on N GPUs, each one's memory
                           per rank (the planner: `python -m bench.memory_plan`)
  planning/memory.py       how a rank's memory is traced, on fake tensors
  planning/memory_terms.py what a GPU process holds beyond the traced tensors, term by term
  planning/published_memory.py  the tutorial's published memory figures, like with like
  planning/fake_world.py   one process as rank r of a world of N (the fake backend)
  planning/collectives.py  every collective of a step, counted where they all pass
  planning/step_trace.py   this rank's step on fake tensors: its compute and collectives
  planning/machines.py     GPUs and networks: their peak rates
  planning/time_model.py   the step's seconds: compute, and each axis's exposed collectives
  planning/planned_job.py  the job of N ranks built, checked and stepped, rank role by role
  planning/predict.py      the dry run's rows: rank roles, layouts, weak scaling
                           (`python -m bench.dry_run` prints them)
"""
