"""Stop cleanly when the scheduler says so.

SLURM sends SIGUSR1 (`#SBATCH --signal=USR1@120`, `scancel --signal=USR1`) or SIGTERM
(`scancel`, and what torchrun forwards to its workers) before killing a job. The handler
only sets a flag; at the next step boundary all ranks agree (an all-reduce of the flag) to
save a checkpoint and exit with EXIT_PREEMPTED, and with --requeue the job puts itself
back in the queue, where the next run resumes from that checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 3


class StopSignal:
    def __init__(self, signals: tuple[int, ...] = (signal.SIGUSR1, signal.SIGTERM)):
        self.received: int | None = None
        for sig in signals:
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        self.received = signum

    def should_stop(self, device: torch.device) -> bool:
        """True on every rank as soon as any rank got a signal (collective when distributed)."""
        flag = 1.0 if self.received is not None else 0.0
        if dist.is_initialized():
            t = torch.tensor([flag], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = t.item()
        return flag > 0


def requeue_slurm_job() -> bool:
    """`scontrol requeue $SLURM_JOB_ID`; False (with a message) outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        log.warning("--requeue: not inside a SLURM job, not requeueing")
        return False
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if result.returncode != 0:
        log.warning(f"scontrol requeue {job} failed: {result.stderr.strip()}")
        return False
    log.info(f"SLURM job {job} requeued; the next run resumes from the checkpoint")
    return True
