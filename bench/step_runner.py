"""One benchmark setting: a run started and built exactly as train.py starts and builds it
(`start_run`, `build_wrapped_model`, `build_training`), its step (`training.step.Step`), a random
batch in memory for the bare step, and what its ceilings, floor and profile need (the eager
model, the precision it computes in)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
from torch.profiler import record_function

from bench import clock
from bench.ceilings import ShapeTrueCeiling, sync
from bench.floor import ElementwiseFloor
from bench.time_split import LOADER_RANGE, LOSS_RANGE, Split, profile_split
from distributed.layout import Layout
from training import compiling
from training.run import build_training, build_wrapped_model
from training.setup import start_run
from training.step import Step
from utils.config_schema import Config
from utils.model_wrappers import uncompiled, unwrap


class StepRunner:
    """One setting, built as train.py builds it, plus one random batch in memory.

    `layout`: the job's layout (any config's); the setting gets its own, of `cfg` and the
    same process groups and device."""

    def __init__(self, label: str, cfg: Config, layout: Layout, step: Step | None = None):
        self.start = time.perf_counter()
        self.label, self.cfg = label, cfg
        self.layout = Layout.of_groups(cfg, layout.env, layout.device)
        self.device = self.layout.device
        self.step = step or Step()
        self.ctx = start_run(cfg, self.layout, announce=False)  # the report is the bench's
        model = build_wrapped_model(cfg, self.layout)  # the layout's layers; DDP; torch.compile
        self.run = build_training(cfg, self.ctx, self.layout, model,
                                  capturable=self.step.capturable)
        self.step.prepare(self.run)
        self.model, self.scheduler = self.run.model, self.run.scheduler
        self.loader, self.sampler = self.run.train_loader, self.run.train_sampler
        self.model.train()
        self.epoch, self.batches = 0, iter(())
        shape = (self.batch, cfg.n_in_channels, *cfg.img_size)
        self.inp = torch.randn(shape, device=self.device)
        self.tar = torch.randn(shape, device=self.device)
        self.step_s = float("nan")  # median full step of the warm-up: for budget estimates
        self.first_step_s = float("nan")  # set-up + the first step (torch.compile included)

    @property
    def dtype(self) -> torch.dtype:
        """The precision its GEMMs run in."""
        return self.ctx.precision.dtype or torch.float32

    @property
    def batch(self) -> int:
        return self.ctx.local_batch_size

    @property
    def prefetched(self) -> int:
        """Batches the loader's workers hold ready; 0 without workers."""
        workers = self.cfg.num_data_workers
        return workers * (getattr(self.loader, "prefetch_factor", None) or 2)

    def _step(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        return self.step(self.run, inp, tar)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        with record_function(LOADER_RANGE):
            try:
                return next(self.batches)
            except StopIteration:  # end of an epoch: train.py starts the next one like this
                self.epoch += 1
                self.sampler.set_epoch(self.epoch)
                self.batches = iter(self.loader)
                return next(self.batches)

    def warm_up(self, n: int) -> None:
        """Untimed steps (torch.compile compiles here); sets `step_s`, the wall time of a
        full step, which the time budget plans with."""
        self.bare(1)
        self.first_step_s = time.perf_counter() - self.start
        self.bare(n - 1)
        self.full(0, untimed=self.prefetched)
        start, n = time.perf_counter(), max(n, 1)
        self.full(n)
        self.step_s = (time.perf_counter() - start) / n

    def bare(self, n: int) -> list[float]:
        """Seconds of each of `n` training steps on the in-memory batch."""
        times = []
        for _ in range(n):
            start = clock.now()
            self._step(self.inp, self.tar)
            sync(self.device)
            times.append(clock.now() - start)
        return times

    def full(self, n: int, untimed: int = 0) -> list[float]:
        """Seconds of each of `n` steps of train.py's loop body, loader included, after
        `untimed` steps that bring the loader's workers to their steady state."""
        times = []
        for i in range(untimed + n):
            start = clock.now()
            self.full_step()
            if i >= untimed:
                times.append(clock.now() - start)
        return times

    def full_step(self) -> None:
        inp, tar = self._next_batch()
        inp = inp.to(self.device, non_blocking=True)
        tar = tar.to(self.device, non_blocking=True)
        loss = self._step(inp, tar)
        self.scheduler.step()
        loss.item()  # train.py sums the losses on the device; this only waits for it

    def record_limits(self) -> tuple[ShapeTrueCeiling, ElementwiseFloor]:
        """The GEMM, attention and FFT calls of one of its training steps (bench/ceilings.py,
        not yet prepared) and its elementwise passes (bench/floor.py, no rates yet),
        recorded from one eager forward and backward at its precision."""
        model = unwrap(self.model)  # torch.compile's graphs hide the calls from the recorder
        loss_fn = uncompiled(self.run.loss)

        def forward_backward() -> None:  # blocks compiled in place run eagerly here too
            with self.ctx.precision.autocast(), compiling.eager():
                loss = loss_fn(model(self.inp), self.tar)
            loss.backward()

        params = sum(p.numel() for p in model.parameters())
        ceiling: list[ShapeTrueCeiling] = []  # one forward and backward, both recorders on
        floor = ElementwiseFloor.record(
            lambda: ceiling.append(ShapeTrueCeiling.record(forward_backward, self.device)),
            params)
        self.run.optimizer.zero_grad(set_to_none=True)  # those gradients are not a step
        return ceiling[0], floor

    def time_split(self, steps: int = 2) -> Split:
        """The full step's time by category, its elementwise time by cause and operator
        (bench/time_split.py); the loss runs inside `LOSS_RANGE` meanwhile."""
        with self._loss_marked():
            return profile_split(self.full_step, steps)

    @contextlib.contextmanager
    def _loss_marked(self) -> Iterator[None]:
        loss = self.run.loss

        def marked(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            with record_function(LOSS_RANGE):
                return loss(pred, target)

        self.run.loss = marked
        try:
            yield
        finally:
            self.run.loss = loss

    def close(self) -> None:
        close = getattr(self.loader, "close", None)
        if close is not None:  # DALI: stop its worker processes now
            close()
        self.run.log.close()
