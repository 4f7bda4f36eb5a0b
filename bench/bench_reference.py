"""Our training step against the same step as the NERSC SC24 tutorial's reference
implementation writes it, one difference at a time, interleaved in one process.

    DATA_DIR=datasets/synthetic python -m bench.bench_reference --config cpu_short \
        --amp_mode auto --enable_fused

The reference's step differs from ours in four implementation choices (same model, same
flags, same data):
  loader     per sample: two HDF5 reads, numpy normalisation, then the DataLoader's collate
             copy (ours: one hyperslab per pair, normalisation over the whole batch);
  optimizer  Adam without `fused` unless --enable_fused, i.e. the per-parameter for-loop on
             a CPU (ours: the fused kernel when enable_fused, as here);
  zero_grad  `optimizer.zero_grad()` at the start of the step: on PyTorch >= 2.0 that sets
             gradients to None, like ours; with `set_to_none=False` (the default before
             2.0) every gradient is zero-filled and then accumulated into;
  loss sync  `loss.item()` after every step, a host sync (ours: the loss is summed on the
             device and read once per epoch).
Each variant below is ours with one choice flipped, and "reference" flips all of them. All
variants start from the same weights and read the same batches (each has its own loader over
the same seeded sample order); in every round each runs a block of `--iters` full steps
(loader, step, scheduler), in a rotating order, and a ratio is formed within the round.
Printed: the median over rounds of (variant step time / our step time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

if __name__ == "__main__":  # before torch loads OpenMP: as train.py (utils/openmp.py)
    from utils.openmp import choose_before_torch

    choose_before_torch(sys.argv[1:])

import torch
from torch.utils.data import DataLoader, Dataset

from bench.budget import Budget
from bench.ceilings import sync
from bench.common import config_of, find_data, machine_label
from bench.step_runner import StepRunner
from distributed.layout import Layout
from training.step import forward_backward, optimizer_step
from utils.allocator import keep_freed_memory
from utils.config import flag_parser
from utils.config_schema import Config

CHOICES = ("loader", "optimizer", "zero_grad", "loss_sync")
VARIANTS: list[tuple[str, frozenset[str]]] = [
    ("ours", frozenset()),
    ("per-sample numpy loader + collate", frozenset({"loader"})),
    ("Adam without fused (for-loop)", frozenset({"optimizer"})),
    ("zero_grad(set_to_none=False)", frozenset({"zero_grad"})),
    ("loss.item() every step", frozenset({"loss_sync"})),
    ("reference: all four", frozenset(CHOICES)),
]


class PerSample(Dataset):
    """The dataset seen one sample at a time (no `__getitems__`): the DataLoader then calls
    `__getitem__` per sample (numpy normalisation) and collates, as the reference does."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset[index]


class Variant(StepRunner):
    """A StepRunner whose step makes the reference's choices named in `flipped`."""

    def __init__(self, label: str, cfg: Config, layout: Layout, flipped: frozenset):
        if "optimizer" in flipped:
            cfg = cfg.replace(enable_fused=False)
        super().__init__(label, cfg, layout)
        self.flipped = flipped
        if "loader" in flipped:
            ours = self.loader
            self.loader = DataLoader(PerSample(ours.dataset), batch_size=ours.batch_size,
                                     sampler=self.sampler, num_workers=ours.num_workers,
                                     persistent_workers=ours.num_workers > 0,
                                     pin_memory=torch.cuda.is_available(), drop_last=True)
        self.loss_sum = torch.zeros((), device=self.device)

    def _step(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        """`training.step.Step`; with zero_grad flipped, the same step (`forward_backward`,
        `optimizer_step`) with the gradients zero-filled at its start instead of set to None
        at its end."""
        if "zero_grad" not in self.flipped:
            return super()._step(inp, tar)
        self.run.optimizer.zero_grad(set_to_none=False)
        loss = forward_backward(self.run, inp, tar)
        optimizer_step(self.run, zero_grad=False)
        return loss.detach()

    def block(self, n: int) -> float:
        """Seconds per step over `n` full steps (the device waited for once, at the end:
        only the loss-sync variant syncs every step)."""
        self.full(0, untimed=self.prefetched)
        start = time.perf_counter()
        for _ in range(n):
            inp, tar = self._next_batch()
            loss = self._step(inp.to(self.device, non_blocking=True),
                              tar.to(self.device, non_blocking=True))
            self.scheduler.step()
            if "loss_sync" in self.flipped:
                loss.item()
            else:
                self.loss_sum += loss
        sync(self.device)
        return (time.perf_counter() - start) / n


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = flag_parser(__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=4, help="full steps per block")
    p.add_argument("--repeats", type=int, default=8, help="interleaved rounds at most")
    p.add_argument("--budget_s", type=float, default=300.0,
                   help="rounds stop when the next would end later than this")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    budget = Budget(args.budget_s)
    cfg = config_of(args)
    layout = Layout.data_parallel(cfg)  # train.py's: joins the job, picks the device
    keep_freed_memory()  # as training.setup.start_run
    cfg, tmp = find_data(cfg)
    cfg = cfg.replace(expdir=tempfile.mkdtemp(prefix="bench_reference_logs_"))
    variants = []
    for label, flipped in VARIANTS:
        v = Variant(label, cfg, layout, flipped)
        v.block(2)  # warm-up (torch.compile compiles here)
        variants.append(v)
    print(f"bench_reference: config {args.config}, amp {variants[0].ctx.precision.mode}, "
          f"fused {cfg.enable_fused}, jit {cfg.enable_jit}; {machine_label(layout.device)}")
    ratios: dict[str, list[float]] = {v.label: [] for v in variants}
    times: dict[str, list[float]] = {v.label: [] for v in variants}
    for rep in range(args.repeats):
        rep_start = time.perf_counter()
        k = rep % len(variants)
        measured = {v.label: v.block(args.iters) for v in variants[k:] + variants[:k]}
        for label, t in measured.items():
            ratios[label].append(t / measured["ours"])
            times[label].append(t)
        if budget.left() < 1.2 * (time.perf_counter() - rep_start):
            break
    print(f"{len(ratios['ours'])} interleaved rounds of {args.iters} full steps per variant; "
          f"1-min load average {os.getloadavg()[0]:.1f}\n")
    print("| variant | ms per step | step time / ours |")
    print("|---|---:|---:|")
    for v in variants:
        print(f"| {v.label} | {1e3 * statistics.median(times[v.label]):.1f} "
              f"| {statistics.median(ratios[v.label]):.3f} |")
    for v in variants:
        v.close()
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main(sys.argv[1:])
