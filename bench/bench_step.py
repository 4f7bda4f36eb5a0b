"""Where does a training step's time go, and how close is it to the hardware? One process,
every timing interleaved.

    DATA_DIR=datasets/synthetic python -m bench.bench_step --config cpu_short
    python -m bench.bench_step --config cpu_short --amp_mode auto --enable_fused --enable_jit
    python -m bench.bench_step --config cpu_short --table --budget_s 120   # docs/benchmarks.md
    python -m bench.bench_step --config cpu_short --amp_modes none bf16   # README step 5

Per setting:
(a) ceilings, for the precision the setting computes in (bench/ceilings.py): one n^3
    `torch.mm` (n = 2048, smaller or skipped where that precision is emulated), and the
    shape-true ceiling: exactly the GEMMs and attention calls of one of its training steps,
    replayed back to back;
(b) bare step: train.py's step (`training.step.Step`) on one random batch kept in memory;
(c) full step: train.py's loop body: the next batch from the real loader (a new epoch when
    one ends), copy in, the step, scheduler step.
In each of `--repeats` rounds every setting (in an order rotating from round to round)
measures (a), then a block of `--iters` steps of (b) and of (c) (the blocks swap places each
round). A block counts its median step;
ratios ((c)/(b), fractions of the ceilings) are formed within a round, and every number
printed is a median over rounds. Then, budget permitting, a profiled pass splits each
setting's full step into GEMM / attention / elementwise+norm / optimizer / loader / Python.
Model FLOP/s are analytic (`networks.training_flops` x samples/s): useful model work.
`--budget_s` bounds the whole run, set-up included: settings that would not fit are skipped
(a torch.compile that runs too long is interrupted), rounds stop when the next would overrun.
`--amp_modes none bf16` times the config in each precision side by side (README step 5): each
one's precision line, then the table and the ratio to the first. A block holds fewer than
`--iters` steps where a setting's steps (an emulated precision's) are too slow for a round
to fit the budget, so it stays about a minute on every CPU.
Every setting is started by `training.setup.start_run`, built by `training.run.build_wrapped_model`
and `build_training`, and steps with `training.step.Step`, exactly as train.py runs them.
Without a data set under the config's data_dir (or DATA_DIR) the loader reads a small
temporary one made by `data.synthetic`.
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

if __name__ == "__main__":
    # Before torch loads OpenMP, the wait policy train.py chooses for --config (one process,
    # one policy: the ladder's other rows run with it too; utils/openmp.py).
    from utils.openmp import choose_before_torch

    choose_before_torch(sys.argv[1:])

import torch

from bench import clock
from bench.budget import Budget, OverBudget
from bench.ceilings import MatmulCeiling, ShapeTrueCeiling, precision_label
from bench.common import config_of, data_paths, find_data, machine_label
from bench.floor import ElementwiseFloor, MachineRates
from bench.report import (
    Limits,
    Summary,
    print_precisions,
    print_report,
    print_split,
    print_table,
    summarise,
)
from bench.step_runner import StepRunner
from bench.time_split import Split
from distributed import comm
from distributed.layout import Layout
from networks import training_flops
from training import compiling
from training.setup import batch_sizes
from utils.allocator import keep_freed_memory
from utils.config import flag_parser, flags_given, load_yaml
from utils.config_schema import Config
from utils.precision import auto_amp_mode, autocast_dtype

# The --table ladder: each row adds one tutorial optimisation to the row above it. Then the
# config's `_opt` relative as written (cpu_short -> cpu_short_opt), when there is one.
LADDER: list[tuple[str, dict[str, Any]]] = [
    ("baseline (fp32)", {"amp_mode": "none", "enable_fused": False, "enable_jit": False,
                         "num_data_workers": 0, "prefetch_thread": False}),
    ("+ num_data_workers 1", {"num_data_workers": 1}),
    ("+ amp_mode auto", {"amp_mode": "auto"}),
    ("+ fused Adam", {"enable_fused": True}),
    ("+ prefetch thread, no worker", {"num_data_workers": 0, "prefetch_thread": True}),
    ("+ torch.compile (enable_jit)", {"enable_jit": True}),
]


@dataclass
class Block:
    """One round of one setting: median seconds per bare and per full step, its n^3 matmul
    ceiling (GFLOP/s) and shape-true ceiling (seconds) before them (None: skipped)."""
    bare_s: float
    full_s: float
    mm_gflops: float | None
    shape_true_s: float | None


def resolved(amp_mode: str, device: torch.device) -> str:
    """What `amp_mode` computes in on `device` ('auto': this hardware's choice)."""
    return auto_amp_mode(device) if amp_mode == "auto" else amp_mode


def case_config(args: argparse.Namespace, overrides: dict[str, Any], paths: dict[str, str],
                log_dir: str, config: str | None = None) -> Config:
    """The config of one setting: the flags given, then its `overrides`, on `paths`' data,
    logging to `log_dir`."""
    return config_of(args, config).replace(**{**overrides, **paths, "expdir": log_dir})


def ladder_cases(args: argparse.Namespace, paths: dict[str, str], log_dir: str,
                 device: torch.device) -> list[tuple[str, Config]]:
    cases, overrides = [], {}
    for label, change in LADDER:
        overrides = {**overrides, **change}
        if change.get("amp_mode") == "auto":
            label += f" ({resolved('auto', device)} here)"
        cases.append((label, case_config(args, overrides, paths, log_dir)))
    opt = f"{args.config}_opt"
    if opt in load_yaml(args.yaml_config):
        p = case_config(args, {}, paths, log_dir, config=opt)
        same = [i for i, (_, c) in enumerate(cases) if describe(c, device) == describe(p, device)]
        if same:  # a rung of the ladder: say which
            cases[same[-1]] = (f"{cases[same[-1]][0]} = {opt}", cases[same[-1]][1])
        else:
            cases.append((f"{opt} as written ({describe(p, device)})", p))
    return cases


def precision_cases(args: argparse.Namespace, paths: dict[str, str], log_dir: str,
                    device: torch.device) -> list[tuple[str, Config]]:
    """The config as written, once in each of --amp_modes."""
    cases = []
    for mode in dict.fromkeys(args.amp_modes):
        label = f"amp_mode {mode}" + (f" ({resolved(mode, device)} here)" if mode == "auto" else "")
        cases.append((label, case_config(args, {"amp_mode": mode}, paths, log_dir)))
    return cases


def describe(p: Config, device: torch.device) -> str:
    amp = p.amp_mode if p.amp_mode != "auto" else f"auto -> {resolved('auto', device)}"
    loader = f"{p.data_loader_config} loader, workers {p.num_data_workers}"
    if p.prefetch_thread:
        loader += ", prefetch thread"
    return f"amp {amp}, fused {bool(p.enable_fused)}, jit {bool(p.enable_jit)}, {loader}"


def set_up(cases: list[tuple[str, Config]], layout: Layout, budget: Budget,
           warmup: int, iters: int) -> list[StepRunner]:
    """Build and warm up each setting while the budget keeps room for one round of every
    setting built; a setting whose set-up (a torch.compile) would eat that room is
    interrupted and skipped."""
    runners: list[StepRunner] = []
    for label, cfg in cases:
        room = budget.left() - budget.reserve(runners, iters)
        if runners and room < budget.reserve(runners[-1:], iters):
            print(f"  skipped '{label}': its set-up and a round would overrun --budget_s",
                  file=sys.stderr, flush=True)
            continue
        start = time.perf_counter()
        try:
            with budget.alarm(room):
                runner = StepRunner(label, cfg, layout)
                runner.warm_up(warmup)
        except OverBudget:
            print(f"  skipped '{label}': set-up still running after {room:.0f} s would "
                  "overrun --budget_s", file=sys.stderr, flush=True)
            continue
        runners.append(runner)
        print(f"  set up and warmed up '{label}' in {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)
    return runners


def one_round(runners: list[StepRunner], mm: MatmulCeiling,
              ceilings: dict[str, ShapeTrueCeiling], iters: int, rep: int) -> dict[str, Block]:
    blocks = {}
    k = rep % len(runners)  # rotate: no setting always runs first (or after the same one)
    for r in runners[k:] + runners[:k]:
        mm_rate = mm.gflops(r.dtype)
        shape_true = ceilings[r.label].seconds() if r.label in ceilings else None
        medians = {}
        for kind in (("bare", "full") if rep % 2 == 0 else ("full", "bare")):
            times = r.bare(iters) if kind == "bare" else r.full(iters, untimed=r.prefetched)
            medians[kind] = statistics.median(times)
        blocks[r.label] = Block(medians["bare"], medians["full"], mm_rate, shape_true)
    return blocks


def measure(runners: list[StepRunner], mm: MatmulCeiling,
            ceilings: dict[str, ShapeTrueCeiling], iters: int, repeats: int,
            budget: Budget) -> dict[str, list[Block]]:
    """Up to `repeats` rounds, at least one; another only if it fits the budget with room
    for the profiled split (median steps drop the ones other processes happened to slow)."""
    results: dict[str, list[Block]] = {r.label: [] for r in runners}
    start = time.perf_counter()
    for rep in range(repeats):
        rep_start = time.perf_counter()
        for label, block in one_round(runners, mm, ceilings, iters, rep).items():
            results[label].append(block)
        now = time.perf_counter()
        print(f"  round {rep + 1}/{repeats} done ({now - start:.0f} s)", file=sys.stderr,
              flush=True)
        if rep + 1 < repeats and budget.left() < (now - rep_start) + budget.split_cost(runners):
            print(f"  another round would overrun --budget_s: stopping after {rep + 1}",
                  file=sys.stderr, flush=True)
            break
    return results


def time_splits(runners: list[StepRunner], budget: Budget) -> dict[str, Split]:
    """The profiled split of each setting's full step, as many settings as the budget
    allows (the last, usually fastest, first)."""
    splits = {}
    for r in reversed(runners):
        if budget.left() < budget.split_cost([r]):
            break
        splits[r.label] = r.time_split()
    return splits


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = flag_parser(__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=3,
                   help="timed steps per block: per setting and round, bare and full each")
    p.add_argument("--repeats", type=int, default=10,
                   help="interleaved rounds at most (many short rounds: robust to load)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per setting first (torch.compile compiles here); "
                   "default 2, with --amp_modes 1")
    p.add_argument("--budget_s", type=float, default=480.0,
                   help="the whole run, set-up included, ends within about this many seconds")
    p.add_argument("--ceiling_size", type=int, default=2048,
                   help="largest n of the n x n x n matmul ceiling")
    p.add_argument("--clock", choices=sorted(clock.CLOCKS), default="wall",
                   help="time with elapsed time, or with this process's CPU time (steadier "
                   "on a machine shared with other jobs; see bench/clock.py)")
    p.add_argument("--table", action="store_true",
                   help="time the optimisation ladder and print a markdown table")
    p.add_argument("--amp_modes", nargs="+", choices=("none", "bf16", "fp16", "auto"),
                   default=None, help="time the config in each of these precisions, side by "
                   "side: each one's precision line, a table, the ratio to the first")
    p.add_argument("--ddp_ranks", type=int, default=2,
                   help="with --table: also DDP x this many processes of the config as "
                   "written (bench/ddp_step.py); 0: not")
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = 1 if args.amp_modes else 2
    if args.table and args.amp_modes:
        p.error("--table and --amp_modes are two different tables: give one")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    budget = Budget(args.budget_s)
    clock.use(args.clock)
    # Inductor's C++ kernels report themselves to the profiler (a flag check each call
    # otherwise), so that the split can name them (bench/time_split.py). Set in the
    # environment: importing torch._inductor.config now would also fix Inductor's cache at
    # its /tmp default, before the run chooses its own (training/compiling.py).
    os.environ.setdefault("TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE", "1")
    imports_s = budget.elapsed()
    ddp_s = min(90.0, 0.25 * args.budget_s) if args.table and args.ddp_ranks > 1 else 0.0
    budget.seconds -= ddp_s  # kept for the DDP row, launched last
    base = config_of(args)
    compiling.use_compile_cache(base.expdir)  # train.py's cache, before anything asks for one
    layout = Layout.data_parallel(base)  # train.py's: joins the job, picks the device
    device = layout.device
    keep_freed_memory()  # as training.setup.start_run
    base, tmp = find_data(base)
    paths = data_paths(base)
    log_dir = tempfile.mkdtemp(prefix="bench_step_logs_")  # run logs nobody reads
    flops = training_flops(base)
    if args.table:
        cases = ladder_cases(args, paths, log_dir, device)
    elif args.amp_modes:
        cases = precision_cases(args, paths, log_dir, device)
    else:
        p = case_config(args, {}, paths, log_dir)
        cases = [(describe(p, device), p)]
    batch, _ = batch_sizes(cases[0][1], comm.get_size("dp"))
    print(f"bench_step: config {args.config}, batch {batch}, "
          f"{flops / 1e9:.2f} GFLOP per training sample (analytic); {machine_label(device)}")
    dtypes = [autocast_dtype(resolved(p.amp_mode, device)) or torch.float32 for _, p in cases]
    mm = MatmulCeiling(device, dtypes, n=args.ceiling_size, tries=2)
    runners = set_up(cases, layout, budget, args.warmup, args.iters)
    ceilings, floors = limits_of(runners, mm, budget)
    iters = budget.fitting_iters(runners, args.iters)
    load_start = os.getloadavg()[0]
    results = measure(runners, mm, ceilings, iters, args.repeats, budget)
    splits = time_splits(runners, budget)
    summaries = [summarise(r.label, precision_label(r.dtype, device), results[r.label],
                           r.batch, flops, r.first_step_s) for r in runners]
    for r in runners:
        r.close()
    print(f"{args.clock} clock; medians over {summaries[0].rounds} interleaved rounds of "
          f"{iters} bare and {iters} full steps per setting; 1-min load average "
          f"{load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print_limits(runners, mm, ceilings, floors, device, imports_s)
    limits = {k: Limits(ceilings[k].split(), floors[k].seconds(), floors[k].optimizer_seconds())
              for k in ceilings if k in floors}
    report(args, summaries, splits, limits, device)
    budget.seconds += ddp_s
    if ddp_s and budget.left() > 30:
        ddp_row(args, budget, summaries[0])
    print(f"\n{budget.elapsed():.0f} s in all (--budget_s {args.budget_s:.0f})")
    if tmp is not None:
        tmp.cleanup()
    shutil.rmtree(log_dir, ignore_errors=True)


def print_limits(runners: list[StepRunner], mm: MatmulCeiling,
                 ceilings: dict[str, ShapeTrueCeiling], floors: dict[str, ElementwiseFloor],
                 device: torch.device, imports_s: float) -> None:
    kinds = {f"{precision_label(r.dtype, device)}: {describe_ceiling(ceilings.get(r.label))}":
             None for r in runners}
    print(f"n^3 matmul ceiling: {mm.describe()}; shape-true ceiling of a step, "
          f"{'; '.join(kinds)}")
    if floors:
        rates = next(iter(floors.values())).rates
        passes = {f"{precision_label(r.dtype, device)}: {floors[r.label].describe()}": None
                  for r in runners if r.label in floors}
        print(f"elementwise floor (bench/floor.py) at {rates.describe()}: {'; '.join(passes)}")
    print(f"{imports_s:.1f} s from the process start to the first set-up (interpreter, "
          "imports); first step [s] = a setting's set-up and first step (torch.compile "
          "included)\n")


def ddp_row(args: argparse.Namespace, budget: Budget, one_process: Summary) -> None:
    """DDP x --ddp_ranks of the config as written (bench/ddp_step.py), against the first
    setting's samples/s when it computes in the same precision."""
    from bench import ddp_step

    flags = ["--yaml_config", args.yaml_config, "--config", args.config]
    for key, value in flags_given(args).items():  # the config's flags given here
        flags += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    ddp_args = [*flags, "--ranks", str(args.ddp_ranks), "--iters", str(args.iters),
                "--budget_s", f"{budget.left() - 15:.0f}"]
    print(f"\nDDP x {args.ddp_ranks} processes on this machine (bench/ddp_step.py), "
          f"{args.config} as written:\n", flush=True)
    try:
        r = ddp_step.launch(ddp_args, ddp_step.parse_args(ddp_args))
    except RuntimeError as e:
        print(f"  skipped: {e}")
        return
    same = r["precision"] == "none" and one_process.precision == "fp32"
    print(ddp_step.describe(r, one_process.full_sps if same else None))
    print(f"(global batch {r['global_batch']}, local {r['local_batch']}; medians of "
          f"{r['rounds']} interleaved rounds; vs one process = samples/s against "
          f"'{one_process.label}' above)")


def limits_of(runners: list[StepRunner], mm: MatmulCeiling, budget: Budget
              ) -> tuple[dict[str, ShapeTrueCeiling], dict[str, ElementwiseFloor]]:
    """Each setting's shape-true ceiling and elementwise floor, unless replaying the ceiling
    would take more than a twentieth of the time left (an emulated precision: its 256^3
    matmul rate predicts the replay). The machine's bandwidth and transcendental rate are
    measured once, at the size of the floors' typical pass."""
    ceilings, floors = {}, {}
    for r in runners:
        ceiling, floors[r.label] = r.record_limits()
        predicted = ceiling.gemm_gflop / mm.probe[r.dtype]
        if predicted > max(1.0, budget.left() / 20):
            print(f"  '{r.label}': shape-true ceiling skipped (replay ~{predicted:.0f} s at "
                  f"{mm.probe[r.dtype]:.1f} GFLOP/s)", file=sys.stderr, flush=True)
            continue
        ceilings[r.label] = ceiling.prepare()
    passes = sorted(g.nbytes for f in floors.values() for g in f.passes)
    typical = passes[len(passes) // 2] / 3 / 2**20 if passes else 8.0  # MB per operand
    rates = MachineRates.measure(size_mb=max(typical, 0.25))
    for f in floors.values():
        f.rates = rates
    return ceilings, floors


def describe_ceiling(c: ShapeTrueCeiling | None) -> str:
    if c is None:
        return "skipped (emulated precision)"
    n = c.counts()
    fft = f", {n['fft']} FFTs" if n["fft"] else ""
    return (f"{n['gemm']} GEMMs ({c.gemm_gflop:.1f} GFLOP) and {n['attention']} attention "
            f"calls{fft}")


def report(args: argparse.Namespace, summaries: list[Summary], splits: dict[str, Split],
           limits: dict[str, Limits], device: torch.device) -> None:
    if args.amp_modes:
        print_precisions(args.amp_modes, args.config, summaries, device)
    elif args.table:
        print_table(summaries)
    else:
        print_report(summaries[0])
    if splits:
        print()
        print_split(splits, {s.label: s for s in summaries}, limits)


if __name__ == "__main__":
    main(sys.argv[1:])
