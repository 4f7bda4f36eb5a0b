"""Tensor parallelism, measured: per-rank memory, step time and communication for tp = 1, 2, 4.

    python -m bench.bench_mp --config cpu_mp                  # tp 1 2 4, 3 steps each
    python -m bench.bench_mp --config cpu_mp --tp 1 2 --iters 5 --warmup 2
    python -m bench.bench_mp --config cpu_mp --full_batch     # the config's batch 64, slow on CPU

Without a GPU the batch is capped at CPU_BATCH (16) samples unless --local_batch_size or
--full_batch says otherwise: cpu_mp's batch of 64 takes ~45 s per step on 2 busy cores, and the
table should take minutes, not an hour. The table header says which batch was used.

For each tp the script starts `torchrun --nproc_per_node tp` on itself (world = tp, so dp = 1
and every rank sees the whole batch). Each rank joins the job and builds the model as
train_mp.py does (`Layout.model_parallel`, `training.run.build_wrapped_model`: the same
layout-independent initial weights for every tp), Adam and the loss scaler
(`training.run.build_training`), and times the training step (`training.step.Step`) on one
random batch kept in memory (the same batch on every rank, so the data loader is not part of
the measurement). The table shows, per tp:

  params/rank     parameters this rank holds (sharded attention/MLP matmuls + replicated rest)
  model state     16 bytes per parameter: fp32 weights, gradients, Adam's two moments
  RSS after init  resident memory once torch and the process groups are up (before the model)
  peak RSS        the rank's peak resident memory after the timed steps (CPU; on a GPU the
                  peak of allocated CUDA memory): model state + activations + libraries
  step            median over the timed steps of the slowest rank's step (all ranks wait for it)
  CPU s/step      process CPU time of a step, summed over the ranks (median over the steps):
                  the work done, which depends far less than the wall clock on how busy the
                  machine is; it includes OpenMP threads spinning while they wait, so compare
                  rows with equal threads per rank
  comm share      time inside the model-parallel collectives / step time, averaged over ranks.
                  Measured by wrapping the collectives the model uses (torch.distributed
                  all_reduce and the all-gather / reduce-scatter of distributed.helpers) with a
                  wall clock, after a barrier that lines the ranks up at the start of each step.
                  gloo collectives block, so this is transfer time *plus* time waiting for the
                  slower rank; on a GPU the wrapper synchronises the device around each call,
                  which serialises NCCL with compute: an upper bound, not the overlapped cost.
  loss step 1     the first step's loss: equal for every tp (same weights, same batch)

On CPU the point is memory and correctness, not speed: the ranks share the same cores (the
script gives each rank cores / tp threads), so more ranks cannot make a step faster; what tp
buys is less model state per rank. On GPUs, where each rank has its own device, tp also
divides the matmul work.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from utils.openmp import available_cores, choose  # torch-free: the launcher needs no torch

REPO = Path(__file__).resolve().parent.parent
RESULT_TAG = "BENCH_MP_RESULT "
CPU_BATCH = 16  # default batch without a GPU (see the module docstring)
BYTES_PER_PARAM = 16  # fp32 weight + gradient + Adam exp_avg + exp_avg_sq
# Variables a launcher sets: a child must never join an outer job by accident.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="cpu_mp", help="section of the YAML file")
    p.add_argument("--yaml_config", default=str(REPO / "config" / "ViT.yaml"))
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="tp sizes to measure")
    p.add_argument("--iters", type=int, default=3, help="timed steps per tp")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--local_batch_size", type=int, default=None,
                   help="samples per step (dp = 1, so also the global batch); default: "
                        f"the config's global_batch_size, at most {CPU_BATCH} without a GPU")
    p.add_argument("--full_batch", action="store_true",
                   help="use the config's global_batch_size even without a GPU")
    p.add_argument("--threads_per_rank", type=int, default=None,
                   help="torch threads per rank (default: available cores // tp, at least 1)")
    p.add_argument("--amp_mode", choices=["none", "fp16", "bf16", "auto"], default=None)
    p.add_argument("--timeout", type=float, default=900, help="seconds per tp run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------- inside each rank

class CommTimer:
    """Adds up the wall time spent inside the collectives the model-parallel layers call."""

    def __init__(self, sync: Callable[[], None]):
        self.sync = sync
        self.seconds = 0.0

    def wrap(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.seconds += time.perf_counter() - start

        return timed

    def install(self) -> None:
        """distributed.helpers looks these up at call time; mappings and layers go through it."""
        import torch.distributed as dist

        import distributed.helpers as helpers

        dist.all_reduce = self.wrap(dist.all_reduce)
        helpers._all_gather_single = self.wrap(helpers._all_gather_single)
        helpers._reduce_scatter_single = self.wrap(helpers._reduce_scatter_single)


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB -> GiB


def worker(args: argparse.Namespace) -> None:
    import tempfile

    import torch

    from bench.common import data_paths, find_data
    from distributed import comm
    from distributed.layout import Layout
    from training.run import build_training, build_wrapped_model
    from training.setup import peak_memory_gb, start_run
    from utils.config import load_config

    torch.set_num_threads(args.threads)
    tp = args.tp[0]
    flags = ["--yaml_config", args.yaml_config, "--config", args.config, "--tp", str(tp),
             "--cp", "1"]
    if args.local_batch_size is not None:
        flags += ["--local_batch_size", str(args.local_batch_size)]
    if args.amp_mode is not None:
        flags += ["--amp_mode", args.amp_mode]
    os.environ["LOG_DIR"] = tempfile.mkdtemp(prefix="bench_mp_logs_")  # run logs nobody reads
    # As train_mp.py sets a run up: its config and flags, the job's layout, the run's start.
    cfg = load_config(flags, "bench", model_parallel=True)
    layout = Layout.model_parallel(cfg)  # joins the job: the tp x cp x h x w x dp groups
    cfg, data = find_data(cfg) if comm.get_world_rank() == 0 else (cfg, None)
    cfg = cfg.replace(**comm.broadcast_from_rank0(data_paths(cfg)))
    ctx = start_run(cfg, layout)
    rss_init = rss_gb()

    model = build_wrapped_model(cfg, layout)
    run = build_training(cfg, ctx, layout, model)
    model.train()
    shape = (ctx.local_batch_size, cfg.n_in_channels, *cfg.img_size)
    gen = torch.Generator().manual_seed(1234)  # the same batch on every rank
    inp = torch.randn(shape, generator=gen).to(layout.device)
    tar = torch.randn(shape, generator=gen).to(layout.device)

    steps, cpu, comms, first_loss = time_steps(run, inp, tar, args.warmup, args.iters)
    mine = {"params": sum(p.numel() for p in model.parameters()), "rss_init": rss_init,
            "peak": peak_memory_gb(layout.device), "steps": steps, "cpu": cpu, "comms": comms,
            "loss": first_loss, "batch": ctx.local_batch_size,
            "threads": torch.get_num_threads()}
    everyone = from_every_rank(mine)
    if comm.get_world_rank() == 0:
        print(RESULT_TAG + json.dumps(summarise(tp, everyone)), flush=True)
    run.log.close()
    del model, run  # nothing may hold a group when comm.shutdown joins gloo's threads
    comm.shutdown()
    if data is not None:
        data.cleanup()


def time_steps(run: Any, inp: Any, tar: Any, warmup: int, iters: int
               ) -> tuple[list[float], list[float], list[float], float]:
    """Wall and CPU seconds, and seconds inside collectives, of `iters` timed model-parallel
    training steps (after `warmup` untimed ones); and the first step's loss."""
    import torch
    import torch.distributed as dist

    from training.step import Step

    step = Step()  # the step train_mp.py runs

    def sync() -> None:
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)

    timer = CommTimer(sync)
    timer.install()
    steps, cpu, comms, first_loss = [], [], [], None
    for i in range(warmup + iters):
        sync()
        if dist.is_initialized():  # tp = 1 under torchrun is a world of one: no group
            dist.barrier()
        timer.seconds = 0.0
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = step(run, inp, tar).item()  # .item() waits for the device
        elapsed = time.perf_counter() - start
        first_loss = loss if first_loss is None else first_loss
        if i >= warmup:
            steps.append(elapsed)
            cpu.append(time.process_time() - start_cpu)
            comms.append(timer.seconds)
    return steps, cpu, comms, first_loss


def from_every_rank(mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's measurements, on every rank (one small all-gather of Python objects)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def summarise(tp: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from every rank's measurements."""
    slowest = [max(times) for times in zip(*(r["steps"] for r in ranks), strict=True)]
    step = statistics.median(slowest)
    cpu = statistics.median(sum(t) for t in zip(*(r["cpu"] for r in ranks), strict=True))
    share = statistics.mean(sum(r["comms"]) / sum(r["steps"]) for r in ranks)
    params = max(r["params"] for r in ranks)
    return {"tp": tp, "threads": ranks[0]["threads"], "params": params,
            "state_gb": params * BYTES_PER_PARAM / 1024**3,
            "rss_init_gb": max(r["rss_init"] for r in ranks),
            "peak_gb": max(r["peak"] for r in ranks), "step_s": step, "cpu_s": cpu,
            "samples_s": ranks[0]["batch"] / step, "comm_share": share,
            "loss": ranks[0]["loss"], "batch": ranks[0]["batch"]}


# ----------------------------------------------------------------- the launcher

def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, tp: int) -> dict[str, Any]:
    """torchrun this module with --worker on tp processes; returns rank 0's summary row."""
    threads = args.threads_per_rank or max(1, available_cores() // tp)
    worker = ["--config", args.config, "--yaml_config", args.yaml_config, "--tp", str(tp),
              "--iters", str(args.iters), "--warmup", str(args.warmup),
              "--threads", str(threads)]
    if args.local_batch_size is not None:
        worker += ["--local_batch_size", str(args.local_batch_size)]
    if args.amp_mode is not None:
        worker += ["--amp_mode", args.amp_mode]
    return torchrun_result("bench.bench_mp", tp, worker, threads, args.timeout, RESULT_TAG,
                           f"tp={tp}")


def torchrun_result(module: str, nproc: int, worker_args: list[str], threads: int,
                    timeout: float, tag: str, what: str) -> dict[str, Any]:
    """torchrun `module --worker ...` on `nproc` local processes with `threads` threads each;
    rank 0's result: the JSON on the stdout line starting with `tag`."""
    return torchrun_results(module, nproc, worker_args, threads, timeout, tag, what)[0]


def torchrun_results(module: str, nproc: int, worker_args: list[str], threads: int,
                     timeout: float, tag: str, what: str) -> list[dict[str, Any]]:
    """`torchrun_result`'s job; the JSON of every stdout line starting with `tag`, in order."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           "-m", module, "--worker", *worker_args]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p))
    # The wait policy train_mp.py would choose for these ranks (in-memory batches, no loader).
    env.update(choose(0, "pytorch", {**env, "LOCAL_WORLD_SIZE": str(nproc)}).env)
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what}: no result within {timeout:.0f} s") from None
    results = [json.loads(line[len(tag):]) for line in proc.stdout.splitlines()
               if line.startswith(tag)]
    if results and proc.returncode == 0:
        return results
    first = proc.stderr.find("Traceback")  # the failing rank's own traceback, not torchrun's
    tail = "\n".join(proc.stderr[max(first, 0):].splitlines()[:30])
    raise RuntimeError(f"{what}: exit code {proc.returncode}, no result\n{tail}")


def model_summary(args: argparse.Namespace) -> tuple[str, int]:
    from utils.config import read_config

    p = read_config(args.yaml_config, args.config)
    h, w = p.img_size
    text = (f"{h}x{w}, patch {p.patch_size}, embed {p.embed_dim}, depth {p.depth}, "
            f"{p.num_heads} heads, amp {args.amp_mode or p.amp_mode}")
    return text, p.global_batch_size


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| tp | ranks x threads | params/rank (M) | model state/rank (GB) "
             "| RSS after init (GB) | peak RSS/rank (GB) | step (s) | samples/s "
             "| CPU s/step | comm share | loss step 1 |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tp']} | {r['tp']} x {r['threads']} | {r['params'] / 1e6:.2f} "
                     f"| {r['state_gb']:.3f} | {r['rss_init_gb']:.2f} | {r['peak_gb']:.2f} "
                     f"| {r['step_s']:.2f} | {r['samples_s']:.1f} | {r['cpu_s']:.2f} "
                     f"| {100 * r['comm_share']:.0f}% | {r['loss']:.6f} |")
    return "\n".join(lines)


NOTE = """\
On CPU the point is memory and correctness, not speed: the equal step-1 losses show that every
layout computes the same model, and the model state per rank shrinks with tp (the attention and
MLP matmuls are sharded; embeddings, head and norms stay whole). Every row uses the same cores
(cores // tp threads per rank), so tp cannot make a step's work go faster here. CPU s/step,
summed over the ranks, is that work, and tp adds to it (replicated layers, collectives, smaller
matmuls); compare it between rows with equal threads per rank (--threads_per_rank 1), since
waiting OpenMP threads burn CPU too. Wall-clock steps also measure the machine's load: a rank
with several threads stalls whenever another job holds one of its cores. Comm share = time
inside the tp collectives (including waiting for the slower rank) / step time. Peak RSS
includes the libraries (RSS after init) and the activations."""


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.iters < 1 or args.warmup < 0 or any(t < 1 for t in args.tp):
        print("error: --iters and --tp must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    summary, config_batch = model_summary(args)
    if args.local_batch_size is None and not args.full_batch and config_batch > CPU_BATCH:
        import torch

        if not torch.cuda.is_available():
            args.local_batch_size = CPU_BATCH
    batch = args.local_batch_size or config_batch
    batch_note = (f"batch {batch} per step (the config's is {config_batch}: reduced to keep "
                  "a CPU run short; --full_batch for the config's)" if batch < config_batch
                  else f"batch {batch} per step" + (" (the config's global batch)"
                                                   if batch == config_batch else ""))
    print(f"## {args.config}: {summary}", flush=True)
    print(f"world = tp, dp = 1; {batch_note}; random in-memory batch; "
          f"{args.warmup} warm-up + {args.iters} timed steps per tp; "
          f"{available_cores()} cores shared by the ranks.", flush=True)
    from bench.common import run_each  # the launcher itself needs no torch until here

    rows = run_each(args.tp, lambda tp: launch(args, tp), lambda tp: f"tp={tp}")
    if rows is None:
        return 1
    print(flush=True)
    print(table(rows), flush=True)
    print(flush=True)
    print(NOTE, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
