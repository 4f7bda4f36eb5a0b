"""Where does a training step's time go? Three timings in one process, interleaved.

    DATA_DIR=data/synthetic python -m bench.bench_step --config cpu_short
    python -m bench.bench_step --config cpu_short --amp_mode bf16 --enable_fused --enable_jit
    python -m bench.bench_step --config cpu_short --table      # the README's optimisation ladder

(a) ceiling: one 2048 x 2048 x 2048 `torch.mm` in fp32 and in bf16, best of 3 each;
(b) bare step: train.py's `train_step` on one random batch kept in memory;
(c) full step: train.py's loop body: the next batch from the real DataLoader (a new epoch when
    one ends), copy in, `train_step`, scheduler step.
In each of `--repeats` rounds every setting runs (a), a block of `--iters` steps of (b), (a)
again and a block of (c) (the blocks swap places each round), so (a), (b) and (c) see the
same machine load; with --table the settings take turns within each round. A block counts
its median step. The ratios ((c)/(b), fraction of the ceiling) are formed within a round and
every number printed is a median over rounds.
Model FLOP/s are analytic: `networks.training_flops` (matmul FLOPs of forward and backward)
x samples/s, so they count useful model work, not what a kernel executes.
Every setting is built by `utils.training.build_training` and steps with its `train_step`,
exactly as train.py runs them. Without a data set under the config's data_dir (or DATA_DIR)
the loader reads a small temporary one made by `utils.data.synthetic`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

# The OpenMP setting train.py makes before torch loads (see there): time what it runs.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from bench.common import find_data, machine_label
from networks import build_model, training_flops
from utils import comm
from utils.cli import build_parser, load_params
from utils.run.setup import seed_everything, set_batch_sizes
from utils.training import build_training, train_step, wrap_model
from utils.YParams import DATA_PATH_KEYS

# The --table ladder: each row adds one tutorial optimisation to the row above it.
LADDER: list[tuple[str, dict[str, Any]]] = [
    ("baseline (fp32)", {"amp_mode": "none", "enable_fused": False, "enable_jit": False,
                         "num_data_workers": 0}),
    ("+ num_data_workers 1", {"num_data_workers": 1}),
    ("+ bf16 autocast", {"amp_mode": "bf16"}),
    ("+ fused Adam", {"enable_fused": True}),
    ("+ torch.compile (enable_jit)", {"enable_jit": True}),
]
# The fastest mix of flags measured on a 2-core AVX-512 (bf16) CPU at the cpu_short size.
BEST_CPU: tuple[str, dict[str, Any]] = (
    "best CPU: bf16 + fused + compile, workers 0",
    {"amp_mode": "bf16", "enable_fused": True, "enable_jit": True, "num_data_workers": 0})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MatmulCeiling:
    """Best-of-`tries` rate of one n x n x n `torch.mm` (2 n^3 FLOPs) in fp32 and bf16."""

    def __init__(self, device: torch.device, n: int = 2048, tries: int = 3):
        self.device, self.n, self.tries = device, n, tries
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        self.operands = {dt: (a.to(dt), b.to(dt)) for dt in (torch.float32, torch.bfloat16)}
        for a, b in self.operands.values():  # warm-up: first-call set-up is not the ceiling
            torch.mm(a, b)

    def gflops(self, dtype: torch.dtype) -> float:
        a, b = self.operands[dtype]
        best = float("inf")
        for _ in range(self.tries):
            sync(self.device)
            start = time.perf_counter()
            torch.mm(a, b)
            sync(self.device)
            best = min(best, time.perf_counter() - start)
        return 2 * self.n**3 / best / 1e9


class StepRunner:
    """One setting, built as train.py builds it (`build_training`), plus one random batch
    in memory for the bare step."""

    def __init__(self, label: str, params: Any, device: torch.device):
        self.label, self.params, self.device = label, params, device
        seed_everything(params.seed)
        model = wrap_model(build_model(params).to(device), params, device)
        self.run = build_training(params, device, model)
        self.model, self.scheduler = self.run.model, self.run.scheduler
        self.loader, self.sampler = self.run.train_loader, self.run.train_sampler
        self.model.train()
        self.epoch, self.batches = 0, iter(())
        shape = (int(params.local_batch_size), int(params.n_in_channels), *params.img_size)
        self.inp = torch.randn(shape, device=device)
        self.tar = torch.randn(shape, device=device)

    def _step(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        return train_step(self.run, inp, tar)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return next(self.batches)
        except StopIteration:  # end of an epoch: train.py starts the next one like this
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)
            self.batches = iter(self.loader)
            return next(self.batches)

    @property
    def prefetched(self) -> int:
        """Batches the loader's workers hold ready; 0 without workers."""
        workers = int(self.params.num_data_workers or 0)
        return workers * (getattr(self.loader, "prefetch_factor", None) or 2)

    def bare(self, n: int) -> list[float]:
        """Seconds of each of `n` `train_step`s on the in-memory batch."""
        times = []
        for _ in range(n):
            start = time.perf_counter()
            self._step(self.inp, self.tar)
            sync(self.device)
            times.append(time.perf_counter() - start)
        return times

    def full(self, n: int, untimed: int = 0) -> list[float]:
        """Seconds of each of `n` steps of train.py's loop body, loader included, after
        `untimed` steps that bring the loader's workers to their steady state."""
        times = []
        for i in range(untimed + n):
            start = time.perf_counter()
            inp, tar = self._next_batch()
            inp = inp.to(self.device, non_blocking=True)
            tar = tar.to(self.device, non_blocking=True)
            loss = self._step(inp, tar)
            self.scheduler.step()
            loss.item()  # train.py sums the losses on the device; this only waits for it
            if i >= untimed:
                times.append(time.perf_counter() - start)
        return times


@dataclass
class Block:
    """One round of one setting: median seconds per step of a block of bare steps and of a
    block of full steps, and the ceilings (GFLOP/s) measured before each block."""
    bare_s: float
    full_s: float
    ceil32: float
    ceil16: float


@dataclass
class Summary:
    label: str
    bare_sps: float
    full_sps: float
    overhead: float
    bare_gflops: float
    gflops: float
    frac32: float
    frac16: float
    ceil32: float
    ceil16: float
    rounds: int
    overhead_range: tuple[float, float]  # lowest and highest round
    frac32_range: tuple[float, float]


def summarise(label: str, blocks: list[Block], batch: int, flops_per_sample: float) -> Summary:
    """Medians over rounds; ratios are formed within a round first."""
    med = statistics.median
    step_gflop = flops_per_sample * batch / 1e9
    overheads = [b.full_s / b.bare_s for b in blocks]
    fracs = [step_gflop / b.full_s / b.ceil32 for b in blocks]
    return Summary(
        label=label,
        bare_sps=med(batch / b.bare_s for b in blocks),
        full_sps=med(batch / b.full_s for b in blocks),
        overhead=med(overheads),
        bare_gflops=med(step_gflop / b.bare_s for b in blocks),
        gflops=med(step_gflop / b.full_s for b in blocks),
        frac32=med(fracs),
        frac16=med(step_gflop / b.full_s / b.ceil16 for b in blocks),
        ceil32=med(b.ceil32 for b in blocks), ceil16=med(b.ceil16 for b in blocks),
        rounds=len(blocks), overhead_range=(min(overheads), max(overheads)),
        frac32_range=(min(fracs), max(fracs)))


def measure(runners: list[StepRunner], ceiling: MatmulCeiling, iters: int, repeats: int,
            deadline: float) -> dict[str, list[Block]]:
    """`repeats` rounds; in each, every setting runs the ceilings, a block of `iters` bare
    steps, the ceilings, a block of `iters` full steps (the two blocks swap places every
    round). A block's value is its median step, which drops steps that other processes on
    the machine happened to slow. Full steps run in a block, not one at a time between bare
    steps, so that data-loader workers work while the model does, as in training: the
    batches they prefetched while the model stood still are spent in untimed steps first."""
    results: dict[str, list[Block]] = {r.label: [] for r in runners}
    start = time.perf_counter()
    for rep in range(repeats):
        rep_start = time.perf_counter()
        for runner in runners:
            ceils, medians = [], {}
            order = ("bare", "full") if rep % 2 == 0 else ("full", "bare")
            for kind in order:
                ceils.append((ceiling.gflops(torch.float32), ceiling.gflops(torch.bfloat16)))
                times = (runner.bare(iters) if kind == "bare"
                         else runner.full(iters, untimed=runner.prefetched))
                medians[kind] = statistics.median(times)
            results[runner.label].append(Block(
                medians["bare"], medians["full"], statistics.mean(c[0] for c in ceils),
                statistics.mean(c[1] for c in ceils)))
        now = time.perf_counter()
        print(f"  round {rep + 1}/{repeats} done ({now - start:.0f} s)", file=sys.stderr,
              flush=True)
        if rep >= 1 and rep + 1 < repeats and now + (now - rep_start) > deadline:
            print(f"  another round would overrun --budget_s: stopping after {rep + 1}",
                  file=sys.stderr, flush=True)
            break
    return results


def case_params(args: argparse.Namespace, overrides: dict[str, Any],
                data_paths: dict[str, str], log_dir: str) -> Any:
    params = load_params(args)
    params.update({**overrides, **data_paths, "expdir": log_dir})
    set_batch_sizes(params, 1)
    return params


def print_report(s: Summary, n: int) -> None:
    print(f"(a) matmul ceiling, {n}^3 torch.mm: fp32 {s.ceil32:.1f} GFLOP/s, "
          f"bf16 {s.ceil16:.1f} GFLOP/s")
    print(f"(b) bare step (in-memory batch): {s.bare_sps:.1f} samples/s, "
          f"{s.bare_gflops:.1f} GFLOP/s")
    print(f"(c) full step (loader included): {s.full_sps:.1f} samples/s, "
          f"{s.gflops:.1f} GFLOP/s")
    lo, hi = s.overhead_range
    print(f"framework overhead (c)/(b), time per step: {s.overhead:.3f} "
          f"(rounds: {lo:.3f} to {hi:.3f})")
    lo, hi = s.frac32_range
    print(f"model FLOP/s (c): {s.gflops:.1f} GFLOP/s = {s.frac32:.2f} of the fp32 ceiling "
          f"(rounds: {lo:.2f} to {hi:.2f}), {s.frac16:.2f} of the bf16 ceiling")


def print_table(summaries: list[Summary]) -> None:
    print("| setting | samples/s | overhead (c)/(b) | model GFLOP/s | of fp32 ceiling "
          "| of bf16 ceiling |")
    print("|---|---:|---:|---:|---:|---:|")
    for s in summaries:
        print(f"| {s.label} | {s.full_sps:.1f} | {s.overhead:.3f} | {s.gflops:.1f} "
              f"| {s.frac32:.2f} | {s.frac16:.2f} |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser(__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=4,
                   help="timed steps per block: per setting and round, bare and full each")
    p.add_argument("--repeats", type=int, default=10,
                   help="interleaved rounds (many short rounds: robust to other jobs' load)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps per setting first (torch.compile compiles here)")
    p.add_argument("--budget_s", type=float, default=480.0,
                   help="skip the remaining rounds (keeping >= 2) that would end the "
                   "whole run, set-up included, later than this many seconds")
    p.add_argument("--ceiling_size", type=int, default=2048,
                   help="n of the n x n x n matmul ceiling (smaller: faster smoke tests)")
    p.add_argument("--table", action="store_true",
                   help="time the optimisation ladder and print a markdown table")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    deadline = time.perf_counter() + args.budget_s
    _, device = comm.init_process()
    base = load_params(args)
    tmp = find_data(base)
    data_paths = {k: base[k] for k in DATA_PATH_KEYS}
    log_dir = tempfile.mkdtemp(prefix="bench_step_logs_")  # run logs nobody reads
    flops = training_flops(base)
    if args.table:
        cases, overrides = [], {}
        for label, change in LADDER:
            overrides = {**overrides, **change}
            cases.append((label, case_params(args, overrides, data_paths, log_dir)))
        cases.append((BEST_CPU[0], case_params(args, BEST_CPU[1], data_paths, log_dir)))
    else:
        p = case_params(args, {}, data_paths, log_dir)
        label = (f"amp {p.amp_mode}, fused {bool(p.enable_fused)}, jit {bool(p.enable_jit)}, "
                 f"workers {p.num_data_workers}")
        cases = [(label, p)]

    batch = int(cases[0][1].local_batch_size)
    print(f"bench_step: config {args.config}, batch {batch}, "
          f"{flops / 1e9:.2f} GFLOP per training sample (analytic); {machine_label(device)}")
    runners = []
    for label, params in cases:
        start = time.perf_counter()
        runner = StepRunner(label, params, device)
        runner.bare(args.warmup)
        runner.full(args.warmup, untimed=runner.prefetched)
        runners.append(runner)
        print(f"  set up and warmed up '{label}' in {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)
    n_params = sum(p.numel() for p in runners[0].model.parameters())
    load_start = os.getloadavg()[0]
    ceiling = MatmulCeiling(device, n=args.ceiling_size)
    results = measure(runners, ceiling, args.iters, args.repeats, deadline)
    summaries = [summarise(r.label, results[r.label], int(r.params.local_batch_size), flops)
                 for r in runners]
    print(f"{n_params / 1e6:.2f} M parameters; medians over {summaries[0].rounds} interleaved "
          f"rounds of {args.iters} bare and {args.iters} full steps per setting; 1-min load "
          f"average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    if args.table:
        everything = [b for r in runners for b in results[r.label]]
        print(f"matmul ceiling ({args.ceiling_size}^3 torch.mm, median over all blocks): fp32 "
              f"{statistics.median(b.ceil32 for b in everything):.1f} GFLOP/s, bf16 "
              f"{statistics.median(b.ceil16 for b in everything):.1f} GFLOP/s\n")
        print_table(summaries)
    else:
        print(f"setting: {summaries[0].label}")
        print_report(summaries[0], args.ceiling_size)
    if tmp is not None:
        tmp.cleanup()
    shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
