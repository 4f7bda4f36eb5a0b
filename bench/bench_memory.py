"""Memory per rank against layout, measured, beside the planner's estimate; and the step-time
cost of activation checkpointing and of FSDP against DDP in the same layout.

    python -m bench.bench_memory --config cpu_mp --gpus 4 --local_batch_size 4
    python -m bench.bench_memory --config cpu_mp --gpus 4 --iters 0 --json   # memory only

One `torchrun --nproc_per_node gpus` job runs every layout the planner lists for the
config on `--gpus` ranks (planning/layouts.py `layouts`), one after the other in the same
processes (new process groups for each). In each layout, every rank builds what train_mp.py
builds (the layout's model, DDP or FSDP, Adam, the loss and its scaler: training/run.py)
and runs training/step.py's step on a random batch kept in memory:
  - memory: two steps under PyTorch's profiler with `profile_memory`, from before the
    model is built; a rank's peak is the highest sum of the tensor allocations alive it
    recorded (an allocation tracker, not the resident set size; `allocation_peaks`),
    "after forward" the highest up to the end of the first forward pass; the smallest of
    MEASUREMENTS such runs;
  - time: `--iters` steps after one warm-up, without the profiler; the median of the
    slowest rank's steps.
The planner's estimate for the same layout is traced with the CPU's kernels (`--device
cpu`: tensors only, no terms beyond them) for rank 0, which holds the largest part of every uneven
split; the table compares it with rank 0's measured peak. The ratios compare rows measured
side by side in this one run: recompute (blocks) against none, FSDP against DDP, each at
the same layout otherwise. On CPU the ranks share the machine's cores: the ratios say
what a layout costs in work, not what a GPU's step would take.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.bench_mp import torchrun_results
from planning.layouts import PlannedLayout, layouts, model_summary, plan_all
from utils.openmp import available_cores

REPO = Path(__file__).resolve().parent.parent
RESULT_TAG = "BENCH_MEMORY_RESULT "
MIB = 1024**2
MEASUREMENTS = 3  # of each layout's peak, from a new model each time


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="cpu_mp", help="section of the YAML file")
    p.add_argument("--yaml_config", default=str(REPO / "config" / "ViT.yaml"))
    p.add_argument("--gpus", type=int, default=4, help="ranks (processes) of the job")
    p.add_argument("--local_batch_size", type=int, default=None,
                   help="samples per rank (default: the config's global batch / dp)")
    p.add_argument("--iters", type=int, default=3, help="timed steps per layout (0: none)")
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the whole job")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layouts_file", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config_of(args: argparse.Namespace) -> Any:
    from utils.config import read_config

    flags = {"enable_jit": False}  # the planner traces the eager step
    if args.local_batch_size is not None:
        flags["local_batch_size"] = args.local_batch_size
    return read_config(args.yaml_config, args.config, flags=flags)


# ----------------------------------------------------------------- inside each rank

class _Ranges:
    """The step's profiler (training/profiling.py's role): its ranges are profiler
    events, so the end of the forward pass can be found among the allocations."""

    @contextmanager
    def range(self, name: str) -> Iterator[None]:
        import torch

        with torch.profiler.record_function(name):
            yield


def allocation_peaks(prof: Any) -> tuple[int, int]:
    """(peak, peak up to the end of the first "forward" range) of the bytes of the tensor
    allocations alive, from the allocations and frees the profiler recorded, in time order.

    The profiler records only its own threads' events, and a gloo thread drops the last
    reference to the temporary an all-gather or reduce-scatter copies through: that free
    goes unrecorded. A tensor allocated inside a collective (c10d's and gloo's ranges)
    that outlives it unrecorded is counted until the collective's end; any other, until
    its address is handed out again.
    """
    from torch._C._profiler import _EventType

    # (time, bytes (- for a free), address, for a free at a collective's end: which
    # allocation it frees, else -1)
    events, forward_end = [], None
    stack = [(node, None) for node in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, collective = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, fields.ptr, -1))
            if fields.alloc_size > 0 and collective is not None:  # freed by its end at last
                events.append((collective.end_time_ns, -fields.alloc_size, fields.ptr,
                               node.start_time_ns))
            continue
        if node.name == "forward" and (forward_end is None or node.end_time_ns < forward_end):
            forward_end = node.end_time_ns
        if node.name.startswith(("c10d::", "gloo:")):
            collective = node
        stack.extend((child, collective) for child in node.children)
    alive: dict[int, tuple[int, int]] = {}  # address: (bytes, when allocated)
    total = peak = after_forward = 0
    for when, nbytes, ptr, allocated in sorted(events):
        if nbytes > 0:
            total -= alive.pop(ptr, (0, 0))[0]  # reused: freed unrecorded before
            alive[ptr] = (nbytes, when)
            total += nbytes
        elif ptr in alive and allocated in (-1, alive[ptr][1]):
            total -= alive.pop(ptr)[0]
        peak = max(peak, total)
        if forward_end is not None and when <= forward_end:
            after_forward = max(after_forward, total)
    return peak, after_forward


def measure(cfg: Any, layout: PlannedLayout, iters: int) -> dict[str, Any]:
    """This rank's measured peaks and step times in `layout` (collective)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from distributed import comm
    from distributed.layout import Layout
    from training.run import build_optimizer, build_wrapped_model, run_loss
    from training.setup import batch_sizes
    from training.step import Step
    from utils.parallel_axes import config_sizes
    from utils.precision import choose_precision

    run_cfg = cfg.replace(**layout.flags())
    comm.init(run_cfg.parallel_order, **config_sizes(run_cfg))
    device = torch.device("cpu")
    rank = Layout.of_groups(run_cfg, None, device)
    local_batch, _ = batch_sizes(run_cfg, layout.dp)
    gen = torch.Generator().manual_seed(1000 + comm.get_rank("dp"))  # one batch per replica
    shape = (local_batch, run_cfg.n_in_channels, *rank.tile.shape)
    peaks = []
    for _ in range(MEASUREMENTS):  # a lost free only adds: the smallest is the closest
        gc.collect()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model = build_wrapped_model(run_cfg, rank)  # DDP or FSDP over dp, as training wraps it
            precision = choose_precision(run_cfg.amp_mode, device)
            run = SimpleNamespace(
                model=model, optimizer=build_optimizer(run_cfg, model), layout=rank,
                prof=_Ranges(), ctx=SimpleNamespace(precision=precision),
                loss=run_loss(run_cfg, rank, torch.ones(rank.tile.shape[0])),
                scaler=rank.grad_scaler(precision), members=rank.members(run_cfg),
                progress=SimpleNamespace(iters=0))
            inp, tar = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
            step = Step()
            for _ in range(2):
                step(run, inp, tar)
        peaks.append(allocation_peaks(prof))
        del prof
    peak, after_forward = min(p[0] for p in peaks), min(p[1] for p in peaks)
    times = []
    for i in range(1 + iters if iters else 0):
        dist.barrier()
        start = time.perf_counter()
        step(run, inp, tar)
        if i > 0:
            times.append(time.perf_counter() - start)
    del run, model, step
    gc.collect()
    return {"peak": peak, "after_forward": after_forward, "times": times}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from distributed import comm
    from distributed.layout import Layout  # noqa: F401 - imported before groups

    os.environ["LOG_DIR"] = tempfile.mkdtemp(prefix="bench_memory_logs_")
    cfg = config_of(args)
    comm.init_process(cfg.parallel_order)  # joins the job; each layout makes its groups
    todo = [PlannedLayout(**row) for row in json.loads(Path(args.layouts_file).read_text())]
    for layout in todo:
        mine = measure(cfg, layout, args.iters)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if dist.get_rank() == 0:
            slowest = [max(t) for t in zip(*(r["times"] for r in everyone), strict=True)]
            print(RESULT_TAG + json.dumps({
                **asdict(layout), "measured_mib": everyone[0]["peak"] / MIB,
                "measured_max_mib": max(r["peak"] for r in everyone) / MIB,
                "measured_after_forward_mib": everyone[0]["after_forward"] / MIB,
                "step_s": statistics.median(slowest) if slowest else None}), flush=True)
    comm.shutdown()


# ----------------------------------------------------------------- the launcher

def run_job(args: argparse.Namespace, todo: list[PlannedLayout]) -> list[dict[str, Any]]:
    """Every layout of `todo` measured by one torchrun job: rows in the same order."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([asdict(layout) for layout in todo], f)
    threads = max(1, available_cores() // args.gpus)
    worker_args = ["--config", args.config, "--yaml_config", args.yaml_config,
                   "--gpus", str(args.gpus), "--iters", str(args.iters),
                   "--layouts_file", f.name]
    if args.local_batch_size is not None:
        worker_args += ["--local_batch_size", str(args.local_batch_size)]
    try:
        rows = torchrun_results("bench.bench_memory", args.gpus, worker_args, threads,
                                args.timeout, RESULT_TAG, f"{args.gpus} ranks")
    finally:
        os.unlink(f.name)
    if len(rows) != len(todo):
        raise RuntimeError(f"{len(rows)} of {len(todo)} layouts measured")
    return rows


def compare(planned: list[dict[str, Any]], measured: list[dict[str, Any]]
            ) -> list[dict[str, Any]]:
    """One row per layout: the planner's estimate (MiB), rank 0's measured peak, their
    relative error, the step time and its ratios to the same layout without recompute and
    with DDP instead of FSDP."""
    keys = ("dp", "tp", "cp", "h", "w", "fsdp", "activation_checkpointing")
    by_layout = {tuple(m[k] for k in keys): m for m in measured}
    rows = []
    for p in planned:
        m = by_layout[tuple(p[k] for k in keys)]
        planned_mib = p["tensor_peak_gb"] * 1024
        rows.append({**{k: p[k] for k in keys}, "local_batch": p["local_batch"],
                     "planned_mib": planned_mib,
                     "planned_after_forward_mib": p["after_forward_gb"] * 1024,
                     **{k: v for k, v in m.items() if k not in keys},
                     "error": planned_mib / m["measured_mib"] - 1})
    step = {tuple(r[k] for k in keys): r["step_s"] for r in rows}
    for r in rows:
        same = {k: r[k] for k in keys}
        none = step.get(tuple({**same, "activation_checkpointing": "none"}[k] for k in keys))
        ddp = step.get(tuple({**same, "fsdp": False}[k] for k in keys))
        r["vs_no_recompute"] = r["step_s"] / none if r["step_s"] and none else None
        r["vs_ddp"] = r["step_s"] / ddp if r["step_s"] and ddp else None
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| dp | tp | cp | h | w | FSDP | recompute | batch/rank | measured peak (MiB) "
             "| planner (MiB) | error | after forward: measured / planner (MiB) | step (s) "
             "| vs no recompute | vs DDP |",
             "|" + "---:|" * 5 + ":---:|:---:|" + "---:|" * 8]

    def number(x: float | None, digits: int = 2) -> str:
        return f"{x:.{digits}f}" if x is not None else ""

    for r in rows:
        lines.append(
            f"| {r['dp']} | {r['tp']} | {r['cp']} | {r['h']} | {r['w']} "
            f"| {'yes' if r['fsdp'] else ''} | {r['activation_checkpointing']} "
            f"| {r['local_batch']} | {r['measured_mib']:.1f} | {r['planned_mib']:.1f} "
            f"| {100 * r['error']:+.1f}% | {r['measured_after_forward_mib']:.1f} / "
            f"{r['planned_after_forward_mib']:.1f} | "
            f"{number(r['step_s'], 3)} "
            f"| {number(r['vs_no_recompute']) if r['activation_checkpointing'] != 'none' else ''} "
            f"| {number(r['vs_ddp']) if r['fsdp'] else ''} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from utils.errors import UserError

    try:
        cfg = config_of(args)
        todo = layouts(cfg, args.gpus)
        if args.gpus < 1 or args.iters < 0 or not todo:
            raise UserError(f"--gpus {args.gpus}, --iters {args.iters}: expected a number of "
                            "ranks over which the config's batch divides, and iters >= 0")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.time()
    planned = plan_all(cfg, args.gpus, float("inf"), args.gpus, "cpu")
    try:
        measured = run_job(args, todo)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows = compare(planned, measured)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    import torch

    from bench.common import machine_label

    print(f"## {args.config} on {args.gpus} CPU ranks: {model_summary(cfg)}, "
          f"amp {cfg.amp_mode}, "
          f"{'fused ' if cfg.enable_fused else ''}Adam; {available_cores()} cores, "
          f"{max(1, available_cores() // args.gpus)} threads per rank; "
          f"{machine_label(torch.device('cpu'))}; load {os.getloadavg()[0]:.1f}")
    print(table(rows))
    print(f"({len(rows)} layouts in {time.time() - start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
