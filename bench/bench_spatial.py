"""Spatial parallelism, measured: per-rank memory, communication share and all-to-all bytes of
the AFNO's training step on h x w meshes.

    python -m bench.bench_spatial --config cpu_afno                 # 1x1 2x1 1x2 2x2, 3 steps
    python -m bench.bench_spatial --config cpu_afno --mesh 1x1 4x1 --iters 5
    python -m bench.bench_spatial --volumes cpu_afno afno      # formulas: spatial vs tensor

For each mesh the script starts `torchrun --nproc_per_node h*w` on itself (dp = 1: every mesh
holds the whole batch, each rank its tile). Each rank builds the model and run as
train_mp.py does (`Layout.model_parallel`, `training.run.build_wrapped_model` and `build_training`:
`SpatialLayers` when h x w > 1, the layout-independent initial weights), crops one random
in-memory batch (the same on every rank) to its tile, and times the training step
(`training.step.Step`, with the run's loss and the layout's gradient sums) on it.
The table shows, per mesh:

  params/rank     parameters this rank holds (pos_embed is split; everything else is whole)
  model state     16 bytes per parameter: fp32 weights, gradients, Adam's two moments
  activations     bytes autograd keeps for the backward pass during one forward (every
                  distinct tensor saved by a saved-tensors hook; this rank's tile)
  peak RSS        the rank's peak resident memory after the timed steps (libraries included)
  comm share      time inside the collectives (all-to-all of the FFTs, all-reduces of the loss
                  and of the replicated parameters' gradients) / step time, mean over ranks;
                  gloo blocks, so this includes waiting for the slower rank
  all-to-all      bytes all ranks together sent to *other* ranks per step, counted in the
                  run, next to `distributed.fft.alltoall_bytes` x 2 per block (forward and
                  inverse FFT are a round trip; the backward moves the same bytes again)
  all-reduce      payload of this rank's all-reduces per step (each moves ~2 (n-1)/n of it)
  loss step 1     the first step's loss: equal for every mesh (same weights, same batch)

On CPU the ranks share the same cores (cores // ranks threads each, at least one), so a
mesh cannot make a step faster here; what it buys is memory per rank. See
docs/spatial_parallelism.md for the communication volume of spatial vs tensor parallelism.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.bench_mp import (
    BYTES_PER_PARAM,
    CPU_BATCH,
    REPO,
    CommTimer,
    available_cores,
    from_every_rank,
    rss_gb,
    torchrun_result,
)

RESULT_TAG = "BENCH_SPATIAL_RESULT "


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="cpu_afno", help="an AFNO section of the YAML file")
    p.add_argument("--yaml_config", default=str(REPO / "config" / "ViT.yaml"))
    p.add_argument("--mesh", nargs="+", default=["1x1", "2x1", "1x2", "2x2"],
                   help="h x w meshes to measure")
    p.add_argument("--iters", type=int, default=3, help="timed steps per mesh")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--local_batch_size", type=int, default=None,
                   help=f"samples per step (default: the config's, at most {CPU_BATCH})")
    p.add_argument("--timeout", type=float, default=900, help="seconds per mesh")
    p.add_argument("--volumes", nargs="+", metavar="CONFIG", default=None,
                   help="print the communication formulas for these configs and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def parse_mesh(text: str) -> tuple[int, int]:
    h, _, w = text.partition("x")
    if not (h.isdigit() and w.isdigit() and int(h) > 0 and int(w) > 0):
        raise ValueError(f"mesh {text!r}: expected HxW, e.g. 2x1")
    return int(h), int(w)


# ----------------------------------------------------------------- inside each rank

class ByteCounter:
    """Counts what this rank's all-to-alls send to other ranks and its all-reduce payload."""

    def __init__(self) -> None:
        self.alltoall = 0
        self.allreduce = 0

    def install(self) -> None:
        import torch.distributed as dist

        to_all, reduce = dist.all_to_all_single, dist.all_reduce

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                              group=None, **kwargs):
            me = dist.get_rank(group)
            n = input.numel() if input_split_sizes is None else sum(input_split_sizes)
            home = (input_split_sizes[me] if input_split_sizes is not None
                    else n // dist.get_world_size(group))
            self.alltoall += (n - home) * input.element_size()
            return to_all(output, input, output_split_sizes, input_split_sizes, group, **kwargs)

        def all_reduce(tensor, *args, **kwargs):
            self.allreduce += tensor.numel() * tensor.element_size()
            return reduce(tensor, *args, **kwargs)

        dist.all_to_all_single, dist.all_reduce = all_to_all_single, all_reduce


def activation_bytes(run: Any, inp: Any, tar: Any, loss_fn: Any) -> int:
    """Bytes of the distinct tensors autograd saves for backward in one forward."""
    import torch

    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            storage = t.untyped_storage()
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(run.model(inp), tar)
    loss.backward()
    run.optimizer.zero_grad(set_to_none=True)
    params = {p.untyped_storage().data_ptr() for p in run.model.parameters()}
    return sum(n for (ptr, _), n in seen.items() if ptr not in params)  # weights aren't


def worker(args: argparse.Namespace) -> None:
    import tempfile

    import torch
    import torch.distributed as dist

    from bench.common import data_paths, find_data
    from distributed import comm
    from distributed.fft import alltoall_bytes
    from distributed.layout import Layout
    from training.run import build_training, build_wrapped_model
    from training.setup import peak_memory_gb, start_run
    from training.step import Step
    from utils.config import load_config
    from utils.model_wrappers import unwrap

    torch.set_num_threads(args.threads)
    h, w = parse_mesh(args.mesh[0])
    flags = ["--yaml_config", args.yaml_config, "--config", args.config,
             "--h_parallel_size", str(h), "--w_parallel_size", str(w),
             "--local_batch_size", str(args.local_batch_size)]
    os.environ["LOG_DIR"] = tempfile.mkdtemp(prefix="bench_spatial_logs_")
    # As train_mp.py sets a run up: its config and flags, the job's layout, the run's start.
    cfg = load_config(flags, "bench", model_parallel=True)
    layout = Layout.model_parallel(cfg)  # joins the job: the h x w mesh (and dp) groups
    cfg, data = find_data(cfg) if comm.get_world_rank() == 0 else (cfg, None)
    cfg = cfg.replace(**comm.broadcast_from_rank0(data_paths(cfg)))
    ctx = start_run(cfg, layout)
    model = build_wrapped_model(cfg, layout)
    run = build_training(cfg, ctx, layout, model)  # its loaders read the layout's tile
    step = Step()  # the step train_mp.py runs: the run's loss, the layout's gradient sums
    shape = (ctx.local_batch_size, cfg.n_in_channels, *cfg.img_size)
    gen = torch.Generator().manual_seed(1234)  # the same batch on every rank
    inp, tar = (torch.randn(shape, generator=gen) for _ in range(2))
    if layout.kind == "spatial":
        tile = layout.tile
        inp, tar = (x[..., tile.rows, tile.cols].contiguous() for x in (inp, tar))

    counter, timer = ByteCounter(), CommTimer(lambda: None)  # CPU: nothing to synchronise
    counter.install()  # then the timer around the counting wrappers
    dist.all_to_all_single = timer.wrap(dist.all_to_all_single)
    dist.all_reduce = timer.wrap(dist.all_reduce)
    steps, comms, loss = [], [], None
    for _ in range(args.warmup + args.iters):
        if dist.is_initialized():
            dist.barrier()
        timer.seconds, counter.alltoall, counter.allreduce = 0.0, 0, 0
        start = time.perf_counter()
        value = step(run, inp, tar).item()
        steps.append(time.perf_counter() - start)
        comms.append(timer.seconds)
        loss = value if loss is None else loss
    sent = {"alltoall": counter.alltoall, "allreduce": counter.allreduce}  # the last step's
    transform = unwrap(model).blocks[0].filter.transform
    mine = {"params": sum(p.numel() for p in model.parameters()),
            "activations": activation_bytes(run, inp, tar, run.loss),
            "peak": peak_memory_gb(layout.device), "rss": rss_gb(),
            "steps": steps[args.warmup:], "comms": comms[args.warmup:], "loss": loss,
            **sent,
            "threads": torch.get_num_threads()}
    everyone = from_every_rank(mine)
    if comm.get_world_rank() == 0:
        # one device's transform (1 x 1) has no channel split: the balanced one of 1
        formula = 2 * cfg.depth * alltoall_bytes(
            ctx.local_batch_size, transform.modes, cfg.embed_dim, (h, w),
            getattr(transform, "channel_sizes", None))
        print(RESULT_TAG + json.dumps(summarise((h, w), everyone, formula)), flush=True)
    run.log.close()
    del model, run, transform  # nothing may hold a group when comm.shutdown joins gloo
    comm.shutdown()
    if data is not None:
        data.cleanup()


def summarise(mesh: tuple[int, int], ranks: list[dict[str, Any]], formula: int
              ) -> dict[str, Any]:
    slowest = [max(times) for times in zip(*(r["steps"] for r in ranks), strict=True)]
    params = max(r["params"] for r in ranks)
    return {"mesh": f"{mesh[0]}x{mesh[1]}", "ranks": len(ranks), "threads": ranks[0]["threads"],
            "params": params, "state_gb": params * BYTES_PER_PARAM / 1024**3,
            "activations_mb": max(r["activations"] for r in ranks) / 1024**2,
            "peak_gb": max(r["peak"] for r in ranks), "step_s": statistics.median(slowest),
            "comm_share": statistics.mean(sum(r["comms"]) / sum(r["steps"]) for r in ranks),
            "alltoall_mb": sum(r["alltoall"] for r in ranks) / 1024**2,
            "formula_mb": formula / 1024**2,
            "alltoall_exact": sum(r["alltoall"] for r in ranks) == formula,
            "allreduce_mb": max(r["allreduce"] for r in ranks) / 1024**2,
            "loss": ranks[0]["loss"]}


# ----------------------------------------------------------------- formulas

def spatial_bytes(batch: int, grid: tuple[int, int], dim: int, depth: int, shared: int,
                  mesh: tuple[int, int]) -> tuple[float, float]:
    """Bytes one rank sends per training step on an h x w mesh (fp32, even splits, all modes
    kept): (FFT all-to-alls, all-reduce of the `shared` replicated parameters' gradients).

    S = 4 B H W D is one activation of the whole token grid. Each transform sends (w-1)/w
    of the rank's real tile (S / P) over w, and (h-1)/h of its complex pencil (S / P x
    2 KW / W, KW = W/2 + 1) over h. A block runs 2 transforms forward and the same 2 again
    in the backward pass. A ring all-reduce sends 2 (n-1)/n of its payload; the gradients
    are reduced over h, then over w."""
    (H, W), (h, w) = grid, mesh
    S, P, KW = 4 * batch * H * W * dim, h * w, W // 2 + 1
    acts = depth * 4 * S / P * ((w - 1) / w + 2 * KW / W * (h - 1) / h)
    grads = 4 * shared * (2 * (h - 1) / h + 2 * (w - 1) / w)
    return acts, grads


def tensor_parallel_bytes(batch: int, grid: tuple[int, int], dim: int, depth: int,
                          tp: int) -> float:
    """Bytes one rank sends per training step with tensor parallelism over tp ranks of
    transformer blocks of width `dim` on the same tokens: 2 all-reduces of the whole
    activation S forward (after the row-parallel attention projection and fc2) and 2
    backward (before the column-parallel q/k/v and fc1), each 2 (tp-1)/tp S. Replicated
    parameters see every token: no gradient reduction."""
    S = 4 * batch * grid[0] * grid[1] * dim
    return depth * 4 * 2 * (tp - 1) / tp * S


def volumes(config: str, yaml_config: str, batch: int = 16) -> str:
    """Per-rank bytes per training step, spatial meshes vs tensor parallelism, for the
    dimensions of `config` and `batch` samples per model replica."""
    from networks.afno import count_parameters
    from utils.config import read_config

    p = read_config(yaml_config, config)
    grid = (p.img_size[0] // p.patch_size, p.img_size[1] // p.patch_size)
    total = count_parameters(p.embed_dim, p.depth, p.patch_size, p.n_in_channels,
                             p.n_out_channels, grid, p.num_blocks, p.mlp_ratio)
    shared = total - grid[0] * grid[1] * p.embed_dim  # all but pos_embed
    S = 4 * batch * grid[0] * grid[1] * p.embed_dim
    lines = [f"{config}: {grid[0]} x {grid[1]} tokens, embed {p.embed_dim}, depth {p.depth}, "
             f"{total / 1e6:.2f} M parameters, batch {batch} per replica: S = "
             f"{S / 1024**2:.1f} MB per activation",
             "| ranks | layout | activations MB/step/rank | gradients MB/step/rank "
             "| total MB/step/rank |", "|---:|---|---:|---:|---:|"]
    for ranks in (4, 16):
        for h, w in ((ranks // 2 if ranks == 4 else 4, 2 if ranks == 4 else 4), (ranks, 1)):
            if h > grid[0] or w > min(grid[1], p.num_blocks):
                continue
            acts, grads = spatial_bytes(batch, grid, p.embed_dim, p.depth, shared, (h, w))
            lines.append(f"| {ranks} | spatial {h} x {w} | {acts / 1024**2:.1f} "
                         f"| {grads / 1024**2:.1f} | {(acts + grads) / 1024**2:.1f} |")
        acts = tensor_parallel_bytes(batch, grid, p.embed_dim, p.depth, ranks)
        lines.append(f"| {ranks} | tensor parallel {ranks} | {acts / 1024**2:.1f} | 0 "
                     f"| {acts / 1024**2:.1f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------- the launcher

def launch(args: argparse.Namespace, mesh: str) -> dict[str, Any]:
    h, w = parse_mesh(mesh)
    ranks = h * w
    threads = max(1, available_cores() // ranks)
    worker = ["--config", args.config, "--yaml_config", args.yaml_config, "--mesh", mesh,
              "--iters", str(args.iters), "--warmup", str(args.warmup),
              "--threads", str(threads), "--local_batch_size", str(args.local_batch_size)]
    return torchrun_result("bench.bench_spatial", ranks, worker, threads, args.timeout,
                           RESULT_TAG, f"mesh {mesh}")


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| h x w | ranks x threads | params/rank (M) | model state/rank (GB) "
             "| activations/rank (MB) | peak RSS/rank (GB) | step (s) | comm share "
             "| all-to-all MB/step: counted / formula | all-reduce MB/step/rank | loss step 1 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mesh']} | {r['ranks']} x {r['threads']} | {r['params'] / 1e6:.2f} "
                     f"| {r['state_gb']:.3f} | {r['activations_mb']:.1f} | {r['peak_gb']:.2f} "
                     f"| {r['step_s']:.2f} | {100 * r['comm_share']:.0f}% "
                     f"| {r['alltoall_mb']:.2f} / {r['formula_mb']:.2f}"
                     f"{' (equal)' if r['alltoall_exact'] else ' (DIFFERENT)'} "
                     f"| {r['allreduce_mb']:.2f} | {r['loss']:.6f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from utils.config import read_config

    if args.volumes:
        print("\n\n".join(volumes(c, args.yaml_config) for c in args.volumes))
        return 0

    p = read_config(args.yaml_config, args.config)
    if args.local_batch_size is None:
        args.local_batch_size = min(p.global_batch_size, CPU_BATCH)
    if args.worker:
        worker(args)
        return 0
    try:
        [parse_mesh(m) for m in args.mesh]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if p.model != "afno" or args.iters < 1 or args.warmup < 0:
        print(f"error: --config {args.config} is model {p.model}: spatial parallelism is the "
              "AFNO's (e.g. cpu_afno); --iters >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    print(f"## {args.config}: {p.img_size[0]}x{p.img_size[1]}, patch {p.patch_size}, embed "
          f"{p.embed_dim}, depth {p.depth}, {p.num_blocks} blocks; batch "
          f"{args.local_batch_size} (dp = 1), random in-memory batch; {args.warmup} warm-up + "
          f"{args.iters} timed steps; {available_cores()} cores shared by the ranks.", flush=True)
    from bench.common import run_each  # the launcher itself needs no torch until here

    rows = run_each(args.mesh, lambda mesh: launch(args, mesh), str)
    if rows is None:
        return 1
    print(flush=True)
    print(table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
