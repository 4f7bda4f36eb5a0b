"""One job, one run directory, one TensorBoard run, under a real SLURM (tests/slurm_cluster.py).

Two submissions of the same line (submit_pm.sh, the generic site preset, one log root) make
two runs, `job<id>` each, each with its own TensorBoard event file. A third job of the same
config and flags is preempted (SIGUSR1, `--requeue`) and its rerun resumes its own run, not
the other runs, although their checkpoints are newer.

Skipped, with the reason printed, where a private SLURM cluster cannot run (not root, no
packages); SLURM_TESTS_REQUIRED=1 turns that skip into a failure.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from helpers import REPO, generic_job_env, preempt_slurm_job, slurm_job_output
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

from training.checkpoint import list_checkpoints

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

SHORT = ["--config=tiny", "--num_iters=8", "--checkpoint_interval=4"]
LONG_ITERS = 64  # 8 epochs: still training when the signal arrives
# The preempted job's flags differ only in how long and how it is kept: the same run label.
LONG = ["--config=tiny", f"--num_iters={LONG_ITERS}", "--checkpoint_interval=0", "--requeue"]
JOB_TIMEOUT = 300  # seconds per job on a loaded 2-core machine (~20 s idle)


def job_env(cluster, data: Path, log_dir: Path) -> dict[str, str | None]:
    return generic_job_env(DATA_DIR=str(data), LOG_DIR=str(log_dir), OMP_NUM_THREADS="1")


def tensorboard_runs(log_dir: Path) -> list[str]:
    return sorted(EventMultiplexer().AddRunsFromDirectory(str(log_dir)).Runs())


def test_two_jobs_of_one_line_are_two_runs_and_a_requeued_job_resumes_its_own(
        cluster, tiny_data, tmp_path):
    log_dir, runs = tmp_path / "logs", tmp_path / "logs" / "tiny" / "1CPU"
    env = job_env(cluster, tiny_data, log_dir)

    def submit(args: list[str], *opts: str) -> int:
        return cluster.submit("submit_pm.sh", args, env=env, cwd=str(REPO),
                              sbatch_opts=[*opts, f"--output={tmp_path}/%x-%j.out"])

    first, second = submit(SHORT), submit(SHORT)  # the same line twice, side by side
    outs = {job: slurm_job_output(cluster, job, JOB_TIMEOUT) for job in (first, second)}
    for job, out in outs.items():
        run = runs / f"job{job}"
        assert f"Run directory {run} (a new run)" in out, out[-3000:]
        assert len(list((run / "logs").glob("events.out.tfevents.*"))) == 1
        # their checkpoints are the newest of this config and these flags from now on
        for ckpt in list_checkpoints(str(run)):
            os.utime(ckpt, (time.time() + 3600, time.time() + 3600))
    assert tensorboard_runs(log_dir) == [f"tiny/1CPU/job{first}/logs",
                                         f"tiny/1CPU/job{second}/logs"]

    preempted = submit(LONG, "--open-mode=append")
    out, k = preempt_slurm_job(cluster, preempted, JOB_TIMEOUT)
    own = runs / f"job{preempted}"
    assert f"SLURM job {preempted} requeued" in out
    assert f"Run directory {own} (a new run)" in out
    assert f"Run directory {own} (SLURM restart 1 of job {preempted}: its own run)" in out
    assert f"Resumed from {own / 'checkpoints' / f'ckpt_{k:08d}.pt'}: iteration {k}," in out
    assert f"Finished {LONG_ITERS} iterations" in out

    assert sorted(p.name for p in runs.iterdir()) == \
        sorted(f"job{j}" for j in (first, second, preempted))
    assert len(tensorboard_runs(log_dir)) == 3
    # the two parts of the preempted job are one curve: no step written twice
    acc = EventAccumulator(str(own / "logs"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("Loss/train")]
    assert steps == sorted(set(steps)) and steps[-1] == LONG_ITERS, steps
