"""Preemption under a real SLURM (tests/slurm_cluster.py): a job sent SIGUSR1 checkpoints,
requeues itself (`--requeue`), and its rerun (SLURM_RESTART_COUNT=1) resumes by itself and
ends bitwise equal to an uninterrupted job.

Both jobs run submit_pm.sh with the generic site preset, side by side. The only difference
on their command lines is `--requeue`; the preempted job is submitted with
`--open-mode=append` so that its output file holds both runs.

Skipped, with the reason printed, where a private SLURM cluster cannot run (not root, no
packages); SLURM_TESTS_REQUIRED=1 turns that skip into a failure.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import (
    REPO,
    assert_same_state,
    final_checkpoint,
    generic_job_env,
    preempt_slurm_job,
    slurm_job_output,
)
from slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

ITERS = 96  # 12 epochs: the job is still training when the signal arrives
JOB_TIMEOUT = 300  # seconds per job on a loaded 2-core machine (~30 s idle)


def _submit(cluster: SlurmCluster, workdir: Path, data: Path, name: str,
            extra_args: list[str]) -> int:
    env = generic_job_env(DATA_DIR=str(data), LOG_DIR=str(workdir / name),
                          OMP_NUM_THREADS="1")
    args = ["--config=tiny", f"--num_iters={ITERS}", "--checkpoint_interval=0", *extra_args]
    return cluster.submit("submit_pm.sh", args, env=env, cwd=str(REPO),
                          sbatch_opts=["--open-mode=append", f"--job-name=requeue-{name}",
                                       f"--output={workdir}/%x-%j.out"])


def test_usr1_checkpoints_requeues_and_the_rerun_resumes_exactly(cluster, tiny_data,
                                                                   tmp_path):
    reference = _submit(cluster, tmp_path, tiny_data, "reference", [])
    preempted = _submit(cluster, tmp_path, tiny_data, "preempted", ["--requeue"])
    out, k = preempt_slurm_job(cluster, preempted, JOB_TIMEOUT)
    assert 1 <= k < ITERS
    assert f"SLURM job {preempted} requeued" in out
    assert "SLURM restart 1 of a --requeue job: resuming" in out  # no --resume needed
    assert re.search(rf"Resumed from \S+ckpt_{k:08d}\.pt: iteration {k},", out), out[-4000:]
    assert out.count("site=generic") == 2  # two runs of the batch script, one output file
    assert f"Finished {ITERS} iterations" in out

    ref_out = slurm_job_output(cluster, reference, JOB_TIMEOUT)
    assert "Resumed" not in ref_out and f"Finished {ITERS} iterations" in ref_out
    # Each job ran in a directory named by its job id; the rerun continued its own.
    runs = tmp_path / "preempted" / "tiny" / "1CPU"
    assert [p.name for p in runs.iterdir()] == [f"job{preempted}"]
    assert f"Run directory {runs / f'job{preempted}'} (SLURM restart 1 of job {preempted}" in out
    assert_same_state(final_checkpoint(runs / f"job{preempted}"),
                      final_checkpoint(tmp_path / "reference" / "tiny" / "1CPU" /
                                       f"job{reference}"))
