"""Which layouts of a config fit a GPU, before the job waits in a queue: the memory planner.

    python -m bench.memory_plan --config mp --gpus 16 --gpu_memory_gb 40
    python -m bench.memory_plan --config mp --gpus 16 --gpu_memory_gb 80 --json
    python -m bench.memory_plan --config cpu_mp --gpus 4 --device cpu   # CPU: tensors only

For every layout the config can run in on `--gpus` ranks (planning/layouts.py: every split
the config's schema accepts, DDP or FSDP, recompute or not, the config's precision), one
rank's peak memory, from a trace of the training step on fake tensors by PyTorch's memory
trackers (planning/memory.py says how), split into parameters, gradients, optimizer
state, activations, communication buffers, and on a GPU the stated allowance for what no
tensor shows (planning/memory.py: one place, and how it is calibrated). Also the peak up
to the end of the first forward pass, the figure the tutorial's logs print. Then which
layouts fit, and the fastest that fits by the planner's rule (planning/layouts.py);
`python -m bench.dry_run` adds how fast each is.
GB in the output are GiB (2^30 bytes), as torch.cuda reports them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


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


def table(rows: list[dict[str, Any]], device_type: str) -> str:
    axes = ["dp", "tp", "cp", "h", "w"] + (["ens"] if any(r["ens"] > 1 for r in rows) else [])
    head = ("| " + " | ".join(axes) + " | FSDP | recompute | params | grads | Adam | "
            "activations | comm | allowance | peak | after forward | fits |")
    lines = [head, "|" + "---:|" * len(axes) + ":---:|:---:|" + "---:|" * 8 + ":---:|"]
    for r in rows:
        mark = "**fastest**" if r["fastest"] else ("yes" if r["fits"] else "no")
        gb = [r[k] for k in ("parameters_gb", "gradients_gb", "optimizer_gb",
                             "activations_gb", "communication_gb", "allowance_gb",
                             "peak_gb", "after_forward_gb")]
        lines.append("| " + " | ".join(str(r[a]) for a in axes)
                     + f" | {'yes' if r['fsdp'] else ''} | {r['activation_checkpointing']} | "
                     + " | ".join(f"{v:.2f}" for v in gb) + f" | {mark} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from planning.fake_world import require_collectives_on_fake_tensors
    from planning.layouts import Layout, layouts, model_summary, plan_all
    from planning.memory import ALLOWANCE_SOURCE, CONTEXT_GIB, FRAGMENTATION
    from utils.config import read_config
    from utils.errors import UserError

    try:
        require_collectives_on_fake_tensors()
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
        print(f"allowance: {CONTEXT_GIB} GB (CUDA context, libraries, NCCL, memory the card "
              f"keeps) + {FRAGMENTATION:.0%} of the tensors' peak (allocator slack); "
              f"{ALLOWANCE_SOURCE}")
    best = next((r for r in rows if r["fastest"]), None)
    if best is None:
        print(f"nothing fits {args.gpu_memory_gb:g} GB: more GPUs (a smaller local batch, "
              "more ranks to shard over) or a smaller model")
    else:
        picked = Layout(**{k: best[k] for k in ("dp", "tp", "cp", "h", "w", "ens", "fsdp",
                                                "activation_checkpointing")})
        print(f"fastest that fits (rule: planning/layouts.py): {picked.label()}, "
              f"peak {best['peak_gb']:.1f} GB")
    print(f"({len(rows)} layouts traced in {time.time() - start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
