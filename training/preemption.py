"""Stop cleanly when asked to: checkpoint at the next step boundary, exit 3, maybe requeue.

SIGUSR1 and SIGTERM are handled the same way. The handler only sets a flag; after each
optimizer step all ranks agree (an all-reduce of the flag), so a signal that reaches a
single rank stops every rank at the same iteration. They save a checkpoint together and
exit with EXIT_PREEMPTED (3); with `--requeue`, rank 0 first runs
`scontrol requeue $SLURM_JOB_ID`, and the requeued job resumes from that checkpoint.

Which signal reaches the training processes depends on the launcher:

  python train.py            `kill -USR1 <pid>` or `kill -TERM <pid>` (Ctrl-C is SIGINT: it
                             just stops, without a checkpoint).
  torchrun                   send SIGTERM to the torchrun process: its agent forwards SIGTERM
                             to every worker and gives them 30 s to exit (`--shutdown_timeout`
                             or TORCH_ELASTIC_SHUTDOWN_TIMEOUT) before SIGKILL; the workers
                             save within that time. torchrun itself then exits 1 (it
                             reports the signal), the workers with 3. SIGUSR1 sent to torchrun
                             kills the agent (the default action) and leaves its workers
                             running unsupervised, unless torchrun is started with
                             `--signals_to_handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1`
                             (then it forwards SIGUSR1 like SIGTERM). SIGUSR1 or SIGTERM sent
                             to any one worker also works: the all-reduce stops them all.
  srun (submit_pm*.sh)       srun starts every rank as its own task. `#SBATCH
                             --signal=USR1@120` (sbatch --signal=USR1@120) sends SIGUSR1 to
                             every task 120 s before the time limit; `scancel --signal=USR1
                             <job>` does so at once. Do not use `--signal=B:USR1@...`: `B:`
                             signals only the batch shell, not the tasks. At the time limit (and
                             on `scancel <job>`) SLURM sends SIGTERM and, KillWait seconds later
                             (30 s by default), SIGKILL: a save that fits in that window also
                             works without --signal, but the warning gives a safe margin.
                             SLURM signals every process of the step: PyTorch DataLoader
                             workers inherit the handler (and ignore the signal).

The train scripts catch both signals from their first line on (training/signals.py): a
signal during start-up (imports, process groups, model, data) ends the process at once with
"stopped by SIGUSR1 before training started: nothing to save" and exit code 3; the earlier
checkpoints are untouched. Only the interpreter's own start-up, before the script's first
line, still dies of the signal (exit 138 for SIGUSR1, 143 for SIGTERM).

Exit codes of the train scripts: 0 finished; 2 a user error (config, flags, data,
checkpoint, NaN/inf loss: one `error: ...` line); 3 stopped by a signal, a checkpoint was
written (rerun with `--resume`), or nothing was to save yet; anything else is a crash (a
traceback; under torchrun, its summary names the rank that failed first).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess

import torch

from distributed import comm
from training import signals as stop_signals

log = logging.getLogger(__name__)


class StopSignal:
    """Catches SIGUSR1/SIGTERM; `should_stop()` at each step boundary says whether to stop.

    Making one ends the start-up phase of training/signals.py: from here on a signal is a
    request to checkpoint, not to exit at once."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGUSR1, signal.SIGTERM)):
        stop_signals.catch(signals)
        stop_signals.end_startup()

    @property
    def received(self) -> int | None:
        return stop_signals.received()

    # On a GPU the agreement costs a host sync, which would stall the queue of kernels the
    # GPU runs ahead of Python: ask only every few steps there (SLURM warns minutes early).
    GPU_CHECK_EVERY = 10

    def should_stop(self, device: torch.device, iteration: int | None = None) -> bool:
        """True on every rank as soon as any rank got a signal (collective when distributed).

        With `iteration` on a GPU, only every GPU_CHECK_EVERY-th iteration asks; all ranks
        pass the same iteration, so they skip or join the collective together.
        """
        if (device.type == "cuda" and iteration is not None
                and iteration % self.GPU_CHECK_EVERY):
            return False
        return comm.any_rank(self.received is not None, device)


def requeue_slurm_job(timeout: float = 60.0) -> bool:
    """`scontrol requeue $SLURM_JOB_ID`; False (with a warning) outside SLURM or on failure.

    The job must be requeueable (`sbatch --requeue`, or the cluster's JobRequeue=1 default).
    SLURM then ends this run and queues the job again with the same command line and
    SLURM_RESTART_COUNT >= 1; with `--requeue` on that command line the rerun resumes from
    the newest checkpoint (as `--resume` would).
    """
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        log.warning("--requeue: not inside a SLURM job, not requeueing")
        return False
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                                timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning(f"scontrol requeue {job} failed: {e}")
        return False
    if result.returncode != 0:
        log.warning(f"scontrol requeue {job} failed: {result.stderr.strip()}")
        return False
    log.info(f"SLURM job {job} requeued; the next run resumes from the checkpoint")
    return True
