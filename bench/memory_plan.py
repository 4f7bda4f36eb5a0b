"""Which layouts of a config fit a GPU, before the job waits in a queue: the memory planner.

    python -m bench.memory_plan --config mp --gpus 16 --gpu_memory_gb 40
    python -m bench.memory_plan --config mp --gpus 16 --gpu_memory_gb 80 --json
    python -m bench.memory_plan --config cpu_mp --gpus 4 --device cpu   # CPU: tensors only

For every layout the config can run in on `--gpus` ranks (every split the config's schema
accepts: tp x cp for the ViT, h x w for the AFNO, dp what is left and dividing the global
batch; DDP, or FSDP when dp > 1; activation checkpointing none or blocks; the config's
precision), one rank's peak memory, from a trace of the training step on fake tensors by
PyTorch's memory trackers (training/memory_plan.py says how), split into parameters,
gradients, optimizer state, activations, communication buffers, and on a GPU the stated
allowance for what no tensor shows (training/memory_plan.py: one place, and how it is
calibrated). Also the peak up to the end of the first forward pass,
the figure the tutorial's logs print. Then which layouts fit, and the fastest that fits by
this rule, in order:
  1. the model-parallel ranks of a replica within one node (--gpus_per_node): tp, cp and
     the mesh exchange activations inside every block, fast only over NVLink;
  2. no activation checkpointing: recomputing the blocks costs a forward pass more per
     step (docs/memory.md has the measured cost);
  3. fewer model-parallel ranks: each split adds collectives to every block and makes the
     matmuls smaller;
  4. DDP before FSDP: FSDP gathers the parameters once more per step (1.5 times DDP's
     traffic) and its gathers wait in front of the blocks;
  5. the smaller peak.
GB in the output are GiB (2^30 bytes), as torch.cuda reports them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, get_args

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Layout:
    """One way to run the config: the axes' sizes, how dp holds the model, recompute."""

    dp: int
    tp: int = 1
    cp: int = 1
    h: int = 1
    w: int = 1
    fsdp: bool = False
    activation_checkpointing: str = "none"

    @property
    def model_parallel(self) -> int:
        return self.tp * self.cp * self.h * self.w

    def flags(self) -> dict[str, Any]:
        """The config keys that run this layout."""
        return {"tp": self.tp, "cp": self.cp, "h_parallel_size": self.h,
                "w_parallel_size": self.w, "fsdp": self.fsdp,
                "activation_checkpointing": self.activation_checkpointing}

    def label(self) -> str:
        split = " x ".join(f"{a} {n}" for a, n in (("tp", self.tp), ("cp", self.cp),
                                                   ("h", self.h), ("w", self.w)) if n > 1)
        return (f"dp {self.dp}{' FSDP' if self.fsdp else ''}"
                f"{' x ' + split if split else ''}"
                f"{', recompute' if self.activation_checkpointing != 'none' else ''}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="mp", help="section of the YAML file")
    p.add_argument("--yaml_config", default=str(REPO / "config" / "ViT.yaml"))
    p.add_argument("--gpus", type=int, default=16, help="ranks of the job")
    p.add_argument("--gpu_memory_gb", type=float, default=40.0,
                   help="one GPU's memory as sold (40 for an A100 40GB)")
    p.add_argument("--gpus_per_node", type=int, default=4,
                   help="GPUs of a node (the fastest rule keeps a model replica in one)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="whose kernels the trace uses; cpu: the CPU's, no allowance")
    p.add_argument("--json", action="store_true", help="print a JSON list instead")
    return p.parse_args(argv)


def layouts(cfg: Any, gpus: int) -> list[Layout]:
    """Every layout `cfg` can run in on `gpus` ranks: splits the schema accepts (it checks
    the sizes against the model), dp dividing the global batch, FSDP when dp > 1."""
    from utils.config_schema import Config
    from utils.errors import ConfigError
    from utils.parallel_axes import AXES

    axes = [a for a in AXES if a.key is not None]
    divisors = [n for n in range(1, gpus + 1) if gpus % n == 0]
    recompute = get_args(Config.model_fields["activation_checkpointing"].annotation)
    if not recompute:  # Annotated[Literal[...], ...]
        recompute = get_args(get_args(Config.model_fields["activation_checkpointing"]
                                      .annotation)[0])
    found = []
    for sizes in itertools.product(divisors, repeat=len(axes)):
        if gpus % math.prod(sizes):
            continue
        dp = gpus // math.prod(sizes)
        try:
            cfg.replace(**{a.key: n for a, n in zip(axes, sizes, strict=True)})
        except ConfigError:
            continue  # the schema refuses this split for this model
        if cfg.local_batch_size is None and cfg.global_batch_size % dp:
            continue
        named = dict(zip((a.name for a in axes), sizes, strict=True))
        for fsdp in (False, True) if dp > 1 else (False,):
            for ac in recompute:
                found.append(Layout(dp, fsdp=fsdp, activation_checkpointing=ac, **named))
    return sorted(found, key=lambda lay: (lay.model_parallel, lay.tp, lay.cp, lay.h, lay.w,
                                          lay.fsdp, lay.activation_checkpointing))


def fake_world(gpus: int) -> None:
    """A process group of `gpus` ranks in this one process, this being rank 0 (PyTorch's
    fake backend: collectives return at once, moving nothing)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=gpus)


def plan(cfg: Any, layout: Layout, device_type: str) -> dict[str, Any]:
    """One layout's estimate, on rank 0 of the fake world (`fake_world`)."""
    import torch

    from distributed import comm
    from distributed.layout import Layout as RankLayout
    from training.memory_plan import GIB, allowance_gib, trace_layout
    from training.setup import batch_sizes

    run_cfg = cfg.replace(**layout.flags())
    comm.init(run_cfg.parallel_order, tp=layout.tp, cp=layout.cp, h=layout.h, w=layout.w)
    rank = RankLayout.of_groups(run_cfg, None, torch.device("cpu"))
    local_batch, _ = batch_sizes(run_cfg, layout.dp)
    estimate = trace_layout(run_cfg, rank, local_batch, device_type)
    tensors = estimate.peak / GIB
    allowance = allowance_gib(tensors) if device_type == "cuda" else 0.0
    return {**asdict(layout), "amp_mode": cfg.amp_mode, "local_batch": local_batch,
            **{f"{part}_gb": nbytes / GIB for part, nbytes in estimate.parts.items()},
            "allowance_gb": allowance, "tensor_peak_gb": tensors,
            "peak_gb": tensors + allowance, "after_forward_gb": estimate.after_forward / GIB,
            "first_step_gb": estimate.first_step / GIB, "peak_phase": estimate.phase}


def fastest_key(row: dict[str, Any], gpus_per_node: int) -> tuple:
    """The module docstring's rule, as a sort key (smallest first)."""
    model_parallel = row["tp"] * row["cp"] * row["h"] * row["w"]
    return (model_parallel > gpus_per_node, row["activation_checkpointing"] != "none",
            model_parallel, row["fsdp"], row["peak_gb"])


def plan_all(cfg: Any, gpus: int, gpu_memory_gb: float, gpus_per_node: int,
             device_type: str) -> list[dict[str, Any]]:
    """Every layout's row (`plan`), with `fits` and, on the fastest that fits, `fastest`."""
    fake_world(gpus)
    rows = [plan(cfg, layout, device_type) for layout in layouts(cfg, gpus)]
    for row in rows:
        row["fits"] = row["peak_gb"] <= gpu_memory_gb
        row["fastest"] = False
    fitting = [r for r in rows if r["fits"]]
    if fitting:
        min(fitting, key=lambda r: fastest_key(r, gpus_per_node))["fastest"] = True
    return rows


def model_summary(cfg: Any) -> str:
    """The config's model in a few words, for a table's title line."""
    h, w = cfg.img_size
    return (f"{cfg.model}, {h}x{w}, patch {cfg.patch_size}, embed {cfg.embed_dim}, "
            f"depth {cfg.depth}")


def table(rows: list[dict[str, Any]], device_type: str) -> str:
    head = ("| dp | tp | cp | h | w | FSDP | recompute | params | grads | Adam | activations "
            "| comm | allowance | peak | after forward | fits |")
    lines = [head, "|" + "---:|" * 5 + ":---:|:---:|" + "---:|" * 8 + ":---:|"]
    for r in rows:
        mark = "**fastest**" if r["fastest"] else ("yes" if r["fits"] else "no")
        gb = [r[k] for k in ("parameters_gb", "gradients_gb", "optimizer_gb",
                             "activations_gb", "communication_gb", "allowance_gb",
                             "peak_gb", "after_forward_gb")]
        lines.append(f"| {r['dp']} | {r['tp']} | {r['cp']} | {r['h']} | {r['w']} "
                     f"| {'yes' if r['fsdp'] else ''} | {r['activation_checkpointing']} | "
                     + " | ".join(f"{v:.2f}" for v in gb) + f" | {mark} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from utils.config import read_config
    from utils.errors import UserError

    try:
        cfg = read_config(args.yaml_config, args.config, environ={})
        if args.gpus < 1 or args.gpu_memory_gb <= 0:
            raise UserError(f"--gpus {args.gpus} and --gpu_memory_gb {args.gpu_memory_gb}: "
                            "expected a positive number of GPUs and of GB")
        if not layouts(cfg, args.gpus):
            raise UserError(f"config '{args.config}' has no layout on {args.gpus} GPUs: its "
                            f"global batch {cfg.global_batch_size} must divide among the "
                            "data-parallel ranks")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.time()
    rows = plan_all(cfg, args.gpus, args.gpu_memory_gb, args.gpus_per_node, args.device)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"config {args.config}: {model_summary(cfg)}, global batch "
          f"{cfg.global_batch_size}, amp {cfg.amp_mode}; {args.gpus} GPUs of "
          f"{args.gpu_memory_gb:g} GB ({args.gpus_per_node} per node); per rank, GB (GiB)")
    print(table(rows, args.device))
    if args.device == "cuda":
        from training.memory_plan import ALLOWANCE_SOURCE, CONTEXT_GIB, FRAGMENTATION

        print(f"allowance: {CONTEXT_GIB} GB (CUDA context, libraries, NCCL, memory the card "
              f"keeps) + {FRAGMENTATION:.0%} of the tensors' peak (allocator slack); "
              f"{ALLOWANCE_SOURCE}")
    best = next((r for r in rows if r["fastest"]), None)
    if best is None:
        print(f"nothing fits {args.gpu_memory_gb:g} GB: more GPUs (a smaller local batch, "
              "more ranks to shard over) or a smaller model")
    else:
        picked = Layout(**{k: best[k] for k in ("dp", "tp", "cp", "h", "w", "fsdp",
                                                "activation_checkpointing")})
        print(f"fastest that fits (rule: bench/memory_plan.py): {picked.label()}, "
              f"peak {best['peak_gb']:.1f} GB")
    print(f"({len(rows)} layouts traced in {time.time() - start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
