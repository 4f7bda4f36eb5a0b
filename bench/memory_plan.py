"""Which layouts of a config fit a GPU, before the job waits in a queue: the memory planner.

    python -m bench.memory_plan --config mp --gpus 16 --gpu_memory_gb 40
    python -m bench.memory_plan --config mp --gpus 16 --layout tp=4,fsdp=no,recompute=none
    python -m bench.memory_plan --config mp --gpus 16 --gpu_memory_gb 80 --json
    python -m bench.memory_plan --config cpu_mp --gpus 4 --device cpu   # CPU: tensors only
    python -m bench.memory_plan --published       # the tutorial's published runs, side by side
    python -m bench.memory_plan ... --memory_terms memory_terms.json   # measured by gpu-check

For every layout the config can run in on `--gpus` ranks (planning/layouts.py: every split
the config's schema accepts, DDP or FSDP, recompute or not, the config's precision), one
rank's peak memory: the tensors, from a trace of the training step on fake tensors by
PyTorch's memory trackers (planning/memory.py), split into parameters, gradients, optimizer
state, activations and communication buffers; on a GPU every term beyond them, each named
with where its number comes from (planning/memory_terms.py: the allocator's rounding,
workspaces and fragmentation; outside it the CUDA context, the kernels, NCCL's buffers for
the layout's communicators, DALI's). Also the peak up to the end of the first forward pass.
Then which layouts fit what CUDA reports of the GPU, and the fastest that fits by the
planner's rule (planning/layouts.py); `python -m bench.dry_run` adds how fast each is.
GB in the output are GiB (2^30 bytes), as torch.cuda reports them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PARTS = ("parameters", "gradients", "optimizer", "activations", "communication")
FILTER_KEYS = {"dp": int, "tp": int, "cp": int, "h": int, "w": int, "ens": int,
               "fsdp": lambda v: {"yes": True, "no": False}[v],
               "recompute": lambda v: {"none": "none", "blocks": "blocks"}[v]}


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
                   help="whose kernels the trace uses; cpu: the CPU's, the tensors only")
    p.add_argument("--layout", default="",
                   help="only these layouts, e.g. tp=4,fsdp=no,recompute=none (keys: "
                        + ", ".join(FILTER_KEYS) + ")")
    p.add_argument("--memory_terms", default=None,
                   help="the memory_terms.json make gpu-check wrote (default: the "
                        "documented values, planning/memory_terms.py)")
    p.add_argument("--published", action="store_true",
                   help="config mp in the layouts of the tutorial's published runs, beside "
                        "them (planning/published_memory.py)")
    p.add_argument("--json", action="store_true", help="print JSON instead")
    return p.parse_args(argv)


def layout_filter(text: str) -> Callable[[Any], bool] | None:
    """`--layout`'s key=value pairs as a test of a planning.layouts.PlannedLayout (None: all)."""
    from utils.errors import UserError

    if not text:
        return None
    wanted = {}
    for pair in text.split(","):
        key, _, value = pair.strip().partition("=")
        try:
            wanted["activation_checkpointing" if key == "recompute" else key] = \
                FILTER_KEYS[key](value)
        except (KeyError, ValueError):
            raise UserError(f"--layout {text}: {pair.strip()!r} is not key=value with a key of "
                            f"{', '.join(FILTER_KEYS)} (fsdp yes/no, recompute "
                            "none/blocks)") from None
    return lambda lay: all(getattr(lay, k) == v for k, v in wanted.items())


def table(rows: list[dict[str, Any]]) -> str:
    axes = ["dp", "tp", "cp", "h", "w"] + (["ens"] if any(r["ens"] > 1 for r in rows) else [])
    head = ("| " + " | ".join(axes) + " | FSDP | recompute | params | grads | Adam | "
            "activations | comm | tensors | beyond tensors | peak | after forward | fits |")
    lines = [head, "|" + "---:|" * len(axes) + ":---:|:---:|" + "---:|" * 9 + ":---:|"]
    for r in rows:
        mark = "**fastest**" if r["fastest"] else ("yes" if r["fits"] else "no")
        gb = [r[f"{p}_gb"] for p in PARTS] + [
            r["tensor_peak_gb"], r["peak_gb"] - r["tensor_peak_gb"], r["peak_gb"],
            r["after_forward_gb"]]
        lines.append("| " + " | ".join(str(r[a]) for a in axes)
                     + f" | {'yes' if r['fsdp'] else ''} | {r['activation_checkpointing']} | "
                     + " | ".join(f"{v:.2f}" for v in gb) + f" | {mark} |")
    return "\n".join(lines)


def terms_table(rows: list[dict[str, Any]]) -> str:
    """Every term beyond the tensors, per layout (GiB), and where each number comes from."""
    from planning.layouts import PlannedLayout
    from planning.memory_terms import NAMES, SOURCES

    lines = ["| layout | " + " | ".join(NAMES) + " | sum |",
             "|---|" + "---:|" * (len(NAMES) + 1)]
    for r in rows:
        lay = PlannedLayout(**{k: r[k] for k in ("dp", "tp", "cp", "h", "w", "ens", "fsdp",
                                          "activation_checkpointing")})
        terms = r["terms_gb"]
        cells = [f"{terms[n]:.2f}" + (f" ({r['communicators']})" if n == "NCCL buffers"
                                      else "") for n in NAMES]
        lines.append(f"| {lay.label()} | " + " | ".join(cells)
                     + f" | {sum(terms.values()):.2f} |")
    lines += ["", "NCCL buffers (n): n communicators. Where each number comes from:"]
    lines += [f"- {name}: {source}" for name, source in SOURCES.items()]
    return "\n".join(lines)


def published_report(cfg: Any, terms: Any, as_json: bool) -> int:
    """mp in the published runs' layouts (tp 1 on 4 GPUs, tp 4 on 16), beside the figures."""
    from planning import published_memory as pub
    from planning.layouts import plan_all

    rows = []
    for gpus, tp in ((4, 1), (16, 4)):
        rows += plan_all(cfg, gpus, 40.0, 4, "cuda", terms,
                         only=lambda lay, tp=tp: (lay.tp, lay.dp, lay.fsdp,
                                                  lay.activation_checkpointing)
                         == (tp, 4, False, "none"))
    by_tp = {r["tp"]: r for r in rows}
    ooms = {p.edition: p for p in pub.PUBLISHED if p.kind == "oom"}
    out = []
    for p in pub.PUBLISHED:
        own = pub.calibrated(ooms[p.edition], by_tp[1], terms)
        for default, edition in zip(pub.checks(p, by_tp[p.tp], terms),
                                    pub.checks(p, by_tp[p.tp], own), strict=True):
            out.append({"edition": p.edition, "date": p.date, "tp": p.tp, "gpus": p.gpus,
                        "gpu_memory_gb": p.gpu_memory_gb, "what": default.what,
                        "published_gib": default.published, "model_gib": default.model,
                        "error": default.error, "model_own_gib": edition.model,
                        "error_own": edition.error, "later_gib": p.later_gib,
                        "source": p.source})
    fits = [{"edition": p.edition, "tp": p.tp, "gpu_memory_gb": p.gpu_memory_gb,
             "this_code_fits": ours, "tutorial_code_fits": theirs}
            for p, ours, theirs in pub.verdicts(rows, terms)]
    if as_json:
        print(json.dumps({"rows": rows, "checks": out, "fits": fits}, indent=1))
        return 0
    print(table(rows))
    print()
    print(terms_table(rows))
    print("\n| edition | layout | GPU | figure | published | model | error | model, the "
          "edition's own outside | error |\n|---|---|---|---|---:|---:|---:|---:|---:|")
    for c in out:
        print(f"| {c['edition']} | tp {c['tp']} x dp 4 | {c['gpu_memory_gb']:g} GB | "
              f"{c['what']} | {c['published_gib']:.2f} | {c['model_gib']:.2f} | "
              f"{c['error']:+.1%} | {c['model_own_gib']:.2f} | {c['error_own']:+.1%} |")
    print()
    for f in fits:
        print(f"{f['edition']}, tp {f['tp']} on {f['gpu_memory_gb']:g} GB: this code "
              f"{'fits' if f['this_code_fits'] else 'does not fit'}, the tutorial's code "
              f"{'fits' if f['tutorial_code_fits'] else 'does not fit'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from planning.fake_world import require_collectives_on_fake_tensors
    from planning.layouts import PlannedLayout, layouts, model_summary, plan_all
    from planning.memory_terms import MemoryTerms
    from utils.config import read_config
    from utils.errors import UserError

    try:
        require_collectives_on_fake_tensors()
        terms = MemoryTerms.load(args.memory_terms)
        cfg = read_config(args.yaml_config, "mp" if args.published else args.config,
                          environ={})
        only = layout_filter(args.layout)
        if args.gpus < 1 or args.gpu_memory_gb <= 0:
            raise UserError(f"--gpus {args.gpus} and --gpu_memory_gb {args.gpu_memory_gb}: "
                            "expected a positive number of GPUs and of GB")
        if not args.published and not layouts(cfg, args.gpus):
            raise UserError(f"config '{args.config}' has no layout on {args.gpus} GPUs: its "
                            f"global batch {cfg.global_batch_size} must divide among the "
                            "data-parallel ranks")
        if only and not any(only(lay) for lay in layouts(cfg, args.gpus)):
            raise UserError(f"--layout {args.layout}: no layout of config '{args.config}' "
                            f"on {args.gpus} GPUs has these sizes")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.time()
    if args.published:
        return published_report(cfg, terms, args.json)
    rows = plan_all(cfg, args.gpus, args.gpu_memory_gb, args.gpus_per_node, args.device,
                    terms, only)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"config {args.config}: {model_summary(cfg)}, global batch "
          f"{cfg.global_batch_size}, amp {cfg.amp_mode}, loader {cfg.data_loader_config}; "
          f"{args.gpus} GPUs of {args.gpu_memory_gb:g} GB ({args.gpus_per_node} per node"
          + (f", {rows[0]['usable_gb']:.2f} GB usable" if args.device == "cuda" else "")
          + "); per rank, GB (GiB)")
    print(table(rows))
    if args.device == "cuda":
        print()
        print(terms_table(rows))
        print(f"memory terms: {terms.measured or 'the documented defaults'}")
    best = next((r for r in rows if r["fastest"]), None)
    if best is None:
        print(f"nothing fits {args.gpu_memory_gb:g} GB: more GPUs (a smaller local batch, "
              "more ranks to shard over) or a smaller model")
    else:
        picked = PlannedLayout(**{k: best[k] for k in ("dp", "tp", "cp", "h", "w", "ens", "fsdp",
                                                "activation_checkpointing")})
        print(f"fastest that fits (rule: planning/layouts.py): {picked.label()}, "
              f"peak {best['peak_gb']:.1f} GB")
    print(f"({len(rows)} layouts traced in {time.time() - start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
