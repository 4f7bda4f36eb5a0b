"""Data parallelism on this machine, as train.py runs it: DDP x `ranks` processes against one
process, and the share of the step the gradient all-reduce costs.

    python -m bench.ddp_step --config cpu_short             # DDP x 2, fp32 baseline settings
    python -m bench.bench_step --config cpu_short --table   # prints this row too

The launcher starts `torchrun --nproc_per_node ranks` on this module (bench/bench_mp.py's
launcher: cores / ranks threads each). Every rank joins the job as train.py does
(`Layout.data_parallel`) and builds, like bench_step, the same settings as train.py would
(`bench.step_runner.StepRunner`, the config's global batch split over the ranks):
  ddp             DDP with the config's bucket size (`bucket_cap_mb`): gradients are
                  all-reduced bucket by bucket while the backward pass still runs;
  ddp, small buckets  `--small_bucket_mb`: more buckets, more of the all-reduce overlapped
                  with the backward pass, more calls;
  no sync         the same ranks with `noddp` (no gradient all-reduce: wrong training, it
                  measures what the all-reduce costs).
They step in interleaved rounds (a barrier before each block of `--iters` full steps, loader
included); per round, all-reduce share = 1 - (step without sync / step with it): the step
time the gradient all-reduce adds, whatever of it the backward pass did not hide.
Rank 0 prints one JSON result line; `--budget_s` bounds the whole job.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

RESULT_TAG = "BENCH_DDP_RESULT "


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from utils.config import flag_parser  # torch-free

    p = flag_parser(__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="processes (one machine)")
    p.add_argument("--iters", type=int, default=3, help="timed full steps per block")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds at most")
    p.add_argument("--small_bucket_mb", type=int, default=2,
                   help="bucket size of the small-bucket variant (MB)")
    p.add_argument("--budget_s", type=float, default=180.0, help="the whole job, launch included")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace, argv: Sequence[str]) -> None:
    import torch.distributed as dist

    from bench.common import config_of, data_paths, find_data
    from bench.step_runner import StepRunner
    from distributed import comm
    from distributed.layout import Layout

    start = time.perf_counter()
    cfg = config_of(args).replace(expdir=tempfile.mkdtemp(prefix="bench_ddp_logs_"))
    layout = Layout.data_parallel(cfg)  # joins the job: one DDP group over every rank
    cfg, data = find_data(cfg) if comm.get_world_rank() == 0 else (cfg, None)
    cfg = cfg.replace(**comm.broadcast_from_rank0(data_paths(cfg)))
    settings = {"ddp": {}, "ddp, small buckets": {"bucket_cap_mb": args.small_bucket_mb},
                "no sync": {"noddp": True}}
    runners = [StepRunner(label, cfg.replace(**change), layout)
               for label, change in settings.items()]
    for r in runners:
        r.warm_up(2)
    times: dict[str, list[float]] = {r.label: [] for r in runners}
    rounds = 0
    for rep in range(args.repeats):
        round_start = time.perf_counter()
        for r in runners[rep % 3:] + runners[:rep % 3]:
            dist.barrier()
            times[r.label].append(statistics.median(r.full(args.iters, untimed=r.prefetched)))
        rounds += 1
        spent = time.perf_counter() - round_start
        # every rank decides alike: rank 0's clock
        go_on = comm.broadcast_from_rank0(time.perf_counter() - start + 2 * spent
                                          < args.budget_s)
        if not go_on:
            break
    if comm.get_world_rank() == 0:
        print(RESULT_TAG + result(cfg, runners[0], times, rounds, args), flush=True)
    for r in runners:
        r.close()
    dist.barrier()
    runners.clear()  # nothing may hold the group when comm.shutdown joins gloo's threads
    del r
    comm.shutdown()
    if data is not None:
        data.cleanup()


def result(cfg: Any, runner: Any, times: dict[str, list[float]], rounds: int,
           args: argparse.Namespace) -> str:
    import json

    import torch

    med = statistics.median
    share = {k: med(1 - n / d for n, d in zip(times["no sync"], times[k], strict=True))
             for k in ("ddp", "ddp, small buckets")}
    return json.dumps({
        "ranks": args.ranks, "threads": torch.get_num_threads(), "rounds": rounds,
        "local_batch": runner.batch, "global_batch": runner.ctx.global_batch_size,
        "step_s": {k: med(v) for k, v in times.items()}, "share": share,
        "bucket_mb": cfg.bucket_cap_mb, "small_bucket_mb": args.small_bucket_mb,
        "precision": runner.ctx.precision.mode})


def launch(argv: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    """torchrun this module on `args.ranks` processes; rank 0's result."""
    from bench.bench_mp import available_cores, torchrun_result

    threads = max(1, available_cores() // args.ranks)
    return torchrun_result("bench.ddp_step", args.ranks, [*argv, "--worker"], threads,
                           args.budget_s + 60, RESULT_TAG, f"DDP x {args.ranks}")


def describe(r: dict[str, Any], one_process_sps: float | None = None) -> str:
    """The DDP rows as a markdown table (and their ratio to one process' samples/s)."""
    lines = ["| DDP setting | ranks x threads | samples/s (all ranks) | per rank "
             "| vs one process | all-reduce share of the step |",
             "|---|---|---:|---:|---:|---:|"]
    for label, step in r["step_s"].items():
        sps = r["global_batch"] / step
        vs = f"{sps / one_process_sps:.2f}" if one_process_sps else "-"
        share = r["share"].get(label)
        lines.append(f"| {label} ({bucket(r, label)}) | {r['ranks']} x {r['threads']} "
                     f"| {sps:.1f} | {sps / r['ranks']:.1f} | {vs} "
                     f"| {'-' if share is None else f'{100 * share:.0f} %'} |")
    return "\n".join(lines)


def bucket(r: dict[str, Any], label: str) -> str:
    if label == "no sync":
        return "noddp: no gradient all-reduce"
    mb = r["small_bucket_mb"] if "small" in label else r["bucket_mb"]
    return f"bucket_cap_mb {mb}, all-reduce overlapped with backward"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        worker(args, argv)
        return
    r = launch(argv, args)
    print(f"{r['precision']}, global batch {r['global_batch']} (local {r['local_batch']}); "
          f"medians of {r['rounds']} interleaved rounds; 1-min load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    print(describe(r))


if __name__ == "__main__":
    main()
