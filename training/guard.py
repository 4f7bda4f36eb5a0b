"""What happens after every optimizer step besides training: one call, `guard.after_step`.

It owns the run's housekeeping so the loop stays readable: a NaN/inf loss stops the run
without saving; SIGUSR1/SIGTERM (any rank) saves a checkpoint and exits 3, requeueing the
SLURM job with `--requeue`; every `checkpoint_interval` steps a checkpoint is written.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from distributed import comm
from training.preemption import StopSignal, requeue_slurm_job
from utils.config_schema import Config
from utils.errors import EXIT_PREEMPTED, DataError, DivergedError

if TYPE_CHECKING:
    from data.checks import BatchScan
    from training.checkpoint import Checkpointer

log = logging.getLogger(__name__)


class NonFiniteLoss:
    """Remembers the first iteration whose training loss was NaN or inf.

    `record` runs on the device and never waits for it (no host sync: a GPU keeps running
    ahead of Python). `check` reads the result (a sync; an all-reduce when distributed, so
    every rank stops at the same step) and raises DivergedError. The guard checks every
    step on CPU, where reading a value costs nothing, every `GPU_CHECK_EVERY` steps on a GPU,
    and always at the end of an epoch and before writing a checkpoint: no NaN reaches a
    checkpoint. With fp16 the GradScaler already skips steps whose *gradients* overflow;
    a loss that is NaN/inf in the forward pass itself is a real failure and stops the run.
    """

    GPU_CHECK_EVERY = 50

    def __init__(self, device: torch.device):
        self.device = device
        self.first = torch.full((), -1, dtype=torch.int64, device=device)  # -1: none yet

    def record(self, loss: torch.Tensor, iteration: int) -> None:
        self.first.masked_fill_((self.first < 0) & ~torch.isfinite(loss.detach()), iteration)

    def due(self, iteration: int) -> bool:
        return self.device.type != "cuda" or iteration % self.GPU_CHECK_EVERY == 0

    def first_bad_iteration(self) -> int | None:
        """The first iteration whose loss was NaN/inf on any rank (collective), or None."""
        never = torch.iinfo(torch.int64).max
        first = torch.where(self.first < 0, never, self.first)
        if comm.is_distributed():
            torch.distributed.all_reduce(first, op=torch.distributed.ReduceOp.MIN)
        iteration = int(first.item())
        return None if iteration == never else iteration

    def check(self, last_checkpoint: str | None = None,
              culprit: Callable[[int], tuple[str | None, float | None]] | None = None
              ) -> None:
        """Raise on every rank if any rank saw a NaN/inf loss. `culprit(iteration)`
        (collective) reads that iteration's batch again: (its first non-finite value,
        described, or None; the batch's largest |normalised value|, None if unknown)."""
        iteration = self.first_bad_iteration()
        if iteration is None:
            return
        found, largest = culprit(iteration) if culprit is not None else (None, None)
        comm.settle()  # every rank raises now and exits
        kept = f"the last checkpoint, {last_checkpoint or '(none yet)'}, is kept"
        if found:  # bad data, not a diverging model: the lr is not the cause
            raise DataError(f"{found}: the training loss is NaN/inf at iteration {iteration}; "
                            f"stopped without saving ({kept}); fix or replace that sample, "
                            "a resumed run would read it again", every_rank=True)
        finite = "" if largest is None else \
            f"; its batch's data are finite (largest |normalised value| {largest:.3g})"
        raise DivergedError(f"training loss is NaN/inf at iteration {iteration}: stopped "
                            f"without saving; {kept}{finite}: lower the lr, or use bf16 "
                            "instead of fp16")


class RunGuard:
    """Stop signal, NaN check, checkpoint interval, requeue and exit, after each step.

    `scan` (data.checks.BatchScan over this rank's training data) names the sample
    behind a NaN/inf loss; the guard keeps (epoch, batch) of the steps since its last check
    (one on CPU, up to NonFiniteLoss.GPU_CHECK_EVERY on a GPU) to tell it which batch."""

    def __init__(self, cfg: Config, device: torch.device, ckpt: Checkpointer, stop: StopSignal,
                 scan: BatchScan | None = None):
        self.cfg, self.device, self.ckpt, self.stop = cfg, device, ckpt, stop
        self.interval = cfg.checkpoint_interval
        self.nonfinite = NonFiniteLoss(device)
        self.scan = scan
        self.batches: dict[int, tuple[int, int]] = {}  # iteration -> (epoch, batch in it)

    def after_step(self, progress: Any, loss: torch.Tensor) -> None:
        """Called once per optimizer step with the loop's `Progress` and the step's loss."""
        iters = progress.iters
        self.nonfinite.record(loss, iters)  # on the device: no host sync here
        self.batches[iters] = (progress.epoch, progress.epoch_step - 1)
        # Every rank agrees (one all-reduce; every 10th step on a GPU) whether any rank
        # got SIGUSR1/SIGTERM.
        stopping = self.stop.should_stop(self.device, iters)
        save = stopping or (self.interval > 0 and iters % self.interval == 0
                            and iters < self.cfg.num_iters)  # the end saves anyway
        if save or self.nonfinite.due(iters):
            self.check_finite()  # never save after a NaN/inf loss
        if save:
            self.ckpt.save(progress)
        if stopping:
            log.info(f"Signal {self.stop.received} received: stopped at iteration {iters}")
            if self.cfg.requeue and comm.get_world_rank() == 0:
                requeue_slurm_job()
            sys.exit(EXIT_PREEMPTED)

    def check_finite(self) -> None:
        """Raise (on every rank) DataError naming the sample if a NaN/inf loss came from
        non-finite data, DivergedError if the model diverged."""
        self.nonfinite.check(self.ckpt.last_saved, self.culprit)
        self.batches.clear()  # all finite so far

    def culprit(self, iteration: int) -> tuple[str | None, float | None]:
        """Collective: every rank reads its own batch of `iteration` again; the first rank's
        finding with non-finite data wins, else the largest |value| over the ranks."""
        where = self.batches.get(iteration)
        mine: tuple[str | None, float | None] = (None, None)
        if self.scan is not None and where is not None:
            mine = self.scan.find(*where)
        everyone = [mine]
        if comm.is_distributed():
            everyone = [None] * comm.get_world_size()
            torch.distributed.all_gather_object(everyone, mine)
        found = next((f for f, _ in everyone if f), None)
        sizes = [v for _, v in everyone if v is not None]
        return found, (max(sizes) if sizes else None)
