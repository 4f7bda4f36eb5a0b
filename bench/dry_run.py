"""A job of N GPUs built, stepped and planned in this one process: the dry run.

    python -m bench.dry_run --config mp --gpus 1024 --gpus_per_node 4 --tp 4 --local_batch_size 1
    python -m bench.dry_run --config mp --gpus 16 --tp 4 --gpu a100-80gb --json
    python -m bench.dry_run --config mp --gpus 16 --layouts all          # which layout, how fast
    python -m bench.dry_run --config bs256_opt --gpus 16 --scaling 4,16,64,256,1024 \\
        --plot scaling.png                                              # weak scaling
    python -m bench.dry_run --config short --gpus 1 --measured_samples_per_s 60  # calibrate
    python -m bench.dry_run --config mp --gpus 16 --tp 4 --machine_file machine.json

The config and every flag of the train scripts (`--tp`, `--cp`, `--h_parallel_size`,
`--fsdp`, `--activation_checkpointing`, `--amp_mode`, `--local_batch_size`, ...) give the
job; `--gpus` its size. For each rank role (planning/planned_job.py) the job's own code builds
the rank's process groups on PyTorch's fake backend, checks them against the rank
generator, runs one training step on fake tensors with every collective recorded, and the
memory planner traces its peak; the whole job's groups are checked without building them,
and a tensor-parallel group across nodes is refused. The time model (planning/
time_model.py) turns each step into seconds on `--gpu`s joined by `--network`: each operator
at the rate its shape reaches (planning/rates.py: published defaults, or `--machine_file`,
what `make gpu-check` measured), times one `--compute_factor` (calibrate it:
`--measured_samples_per_s` of one run of the same config, flags and GPU count;
docs/scaling.md). It prints the step's collectives, the start-up's groups and splits, each
role's memory and time, samples/s; `--layouts all` every layout the planner lists and the
fastest that fits; `--scaling` a weak-scaling table with what communication alone does not
explain (the input pipeline, stragglers, validation: planning/scaling_terms.py) as a range
(`--plot` draws it); `--json` one object per role, layout or GPU count.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Sequence
from typing import Any

from utils.config import flag_parser, flags_given, read_config

DEFAULT_SCALING = "4,16,64,256,1024"


def parse_args(argv: Sequence[str] | None = None) -> Any:
    p = flag_parser(__doc__.splitlines()[0], model_parallel=True)
    p.add_argument("--gpus", type=int, default=16, help="GPUs (ranks) of the job")
    p.add_argument("--gpus_per_node", type=int, default=None,
                   help="GPUs of a node (default: the network's)")
    p.add_argument("--gpu", default="a100-40gb", help="a100-40gb, a100-80gb, h100 or h200")
    p.add_argument("--network", default=None,
                   help="perlmutter or ib-hgx (default: perlmutter for an A100, else ib-hgx)")
    p.add_argument("--machine_file", default=None,
                   help="the operator rates make gpu-check measured (JSON; default: the "
                        "published rates of --gpu, planning/rates.py)")
    p.add_argument("--compute_factor", type=float, default=None,
                   help="seconds the compute takes per second the rates predict (default: "
                        "calibrated on the tutorial's published runs; 1 with --machine_file)")
    p.add_argument("--link_efficiency", type=float, default=None,
                   help="fraction of the links' peak NCCL reaches (default 0.8)")
    p.add_argument("--measured_samples_per_s", type=float, default=None,
                   help="a measured run of this config, flags and --gpus: calibrates "
                        "--compute_factor")
    p.add_argument("--layouts", choices=["given", "all"], default="given",
                   help="all: every layout the memory planner lists, rank 0 each")
    p.add_argument("--scaling", nargs="?", const=DEFAULT_SCALING, default=None,
                   help=f"GPU counts for weak scaling at this layout's local batch "
                        f"(default {DEFAULT_SCALING})")
    p.add_argument("--plot", default=None, help="with --scaling: write its plot (PNG) here")
    p.add_argument("--json", action="store_true", help="print a JSON list instead")
    return p.parse_args(argv)


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3g} MB"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def split_line(row: dict[str, Any]) -> str:
    exposed = ", ".join(f"{a} {ms(s)}" for a, s in sorted(row["exposed_s"].items()) if s > 0)
    return (f"compute {ms(row['compute_s'])}, exposed communication: {exposed or 'none'}; "
            f"step {ms(row['step_s'])}")


def collectives_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| op | axis | ranks | bytes | count per step | crosses nodes |",
             "|---|---|---:|---:|---:|:---:|"]
    for c in rows:
        lines.append(f"| {c['op']} | {c['axis']} | {c['ranks']} | {c['bytes']:,} | "
                     f"{c['count']} | {'yes' if c['crosses_nodes'] else ''} |")
    return "\n".join(lines)


def print_job(job: Any, rows: list[dict[str, Any]]) -> None:
    first, problems = rows[0], rows[0]["job_problems"]
    start = job.startup()
    print(f"groups of {job.gpus} ranks: " + ("every rank in one group of each axis, the axes "
          "orthogonal" if not problems else "PROBLEMS: " + "; ".join(problems[:5])))
    parts = ", ".join(f"{'/'.join(p['names'])} {p['groups']} x {p['ranks']}"
                      for p in start["partitions"])
    print(f"start-up: {parts or 'no groups'}: {start['groups']} groups made, "
          f"{start['splits']} NCCL communicator splits with split_group "
          f"({start['splits_without_split_group']} without it), "
          f"{start['communicators_per_rank']} communicators per rank")
    for r in rows:
        coords = ", ".join(f"{a} {i}" for a, i in r["coords"].items()
                           if job.generator.sizes[a] > 1)
        print(f"rank {r['rank']} ({coords or 'alone'}): groups "
              f"{'as the rank generator says' if r['groups_ok'] else 'WRONG'}; "
              f"peak {r['peak_gb']:.2f} GB ({r['memory']['peak_phase']}); {split_line(r)}"
              f"; dry run {r['wall_s']:.1f} s")
        for p in r["group_problems"][:3]:
            print(f"  {p}")
    print(f"collectives of one step, rank {first['rank']}:")
    print(collectives_table(first["collectives"]))
    slowest = max(rows, key=lambda r: r["step_s"])
    print(f"time per step (the slowest rank, {slowest['rank']}): {split_line(slowest)} -> "
          f"{slowest['samples_per_s']:,.1f} samples/s")
    fits = "fits" if all(r["fits"] for r in rows) else "DOES NOT FIT"
    print(f"memory: peak {max(r['peak_gb'] for r in rows):.2f} GB of "
          f"{job_gpu_memory(first):g} GB: {fits}")


def job_gpu_memory(row: dict[str, Any]) -> float:
    from planning.machines import GPUS

    return GPUS[row["gpu"]].memory_gb


def layouts_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| dp | tp | cp | h | w | FSDP | recompute | peak GB | fits | compute ms "
             "| exposed ms | step ms | samples/s |",
             "|" + "---:|" * 5 + ":---:|:---:|---:|:---:|" + "---:|" * 4]
    for r in rows:
        mark = ("**fastest**" if r["fastest"] else "yes") if r["fits"] else "no"
        mark += " (tp across nodes)" if r["tp_crosses_nodes"] else ""
        exposed = sum(r["exposed_s"].values())
        lines.append(f"| {r['dp']} | {r['tp']} | {r['cp']} | {r['h']} | {r['w']} | "
                     f"{'yes' if r['fsdp'] else ''} | {r['activation_checkpointing']} | "
                     f"{r['peak_gb']:.2f} | {mark} | {r['compute_s'] * 1e3:.3g} | "
                     f"{exposed * 1e3:.3g} | {r['step_s'] * 1e3:.3g} | "
                     f"{r['samples_per_s']:,.1f} |")
    return "\n".join(lines)


def scaling_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| GPUs | nodes | global batch | step ms | exposed ms | + input, stragglers, "
             "epoch ms (low end) | samples/s | weak-scaling efficiency | peak GB |",
             "|" + "---:|" * 9]
    for r in rows:
        exposed = ", ".join(f"{a} {s * 1e3:.2g}" for a, s in sorted(r["exposed_s"].items())
                            if s > 0) or "0"
        low = r["terms"]["low"]
        added = (f"{low['input_s'] * 1e3:.3g}, {low['straggler_s'] * 1e3:.3g}, "
                 f"{low['epoch_s'] * 1e3:.3g}")
        nodes = -(-r["gpus"] // r["gpus_per_node"])
        lo, hi = r["samples_per_s_range"]
        elo, ehi = r["scaling_efficiency_range"]
        lines.append(f"| {r['gpus']} | {nodes} | {r['global_batch']} | "
                     f"{r['loader_step_s'] * 1e3:.3g} | {exposed} | {added} | "
                     f"{lo:,.0f}-{hi:,.0f} | {elo:.0%}-{ehi:.0%} | {r['peak_gb']:.2f} |")
    return "\n".join(lines)


def scaling_terms_line() -> str:
    """What the scaling table adds to the step, with planning/scaling_terms.py's values."""
    from planning.scaling_terms import EPOCH_OVERHEAD_S, FS_BANDWIDTH, FS_SHARE_LOW, SIGMA

    return ("added to the step (planning/scaling_terms.py), high end / low end: input, the "
            f"file system's {FS_BANDWIDTH / 1e12:g} TB/s over the job's nodes, all of it / "
            f"{FS_SHARE_LOW:.0%} of it; stragglers, the slowest of N ranks at {SIGMA[0]:.1%} "
            f"/ {SIGMA[1]:.1%} jitter; the epoch's validation and {EPOCH_OVERHEAD_S[0]:g} / "
            f"{EPOCH_OVERHEAD_S[1]:g} s, over its steps. The step includes its exposed "
            "communication (the last gradient bucket's all-reduce) and its loader.")


def plot_scaling(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [r["gpus"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ideal = [rows[0]["samples_per_s"] * g / gpus[0] for g in gpus]
    left.loglog(gpus, ideal, "k--", label="ideal (linear)")
    left.loglog(gpus, [r["samples_per_s"] for r in rows], "o-", label="step alone")
    lo, hi = zip(*(r["samples_per_s_range"] for r in rows), strict=True)
    left.fill_between(gpus, lo, hi, alpha=0.3, label="with input, stragglers, epoch")
    left.set(xlabel="GPUs", ylabel="samples/s", title="throughput")
    left.legend()
    low, high = zip(*(r["scaling_efficiency_range"] for r in rows), strict=True)
    right.fill_between(gpus, [100 * v for v in low], [100 * v for v in high], alpha=0.3,
                       label="with input, stragglers, epoch (range)")
    right.semilogx(gpus, [100 * r["scaling_efficiency"] for r in rows], "o-",
                   label="step alone")
    right.set(xlabel="GPUs", ylabel="%", title="weak-scaling efficiency", ylim=(0, 105))
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xticks(gpus, [str(g) for g in gpus])
        ax.minorticks_off()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    from utils.config import FlagError
    from utils.errors import UserError

    try:
        args = parse_args(argv)
    except FlagError as e:  # as argparse says it: the usage line, then the error
        print(f"{e.usage}{e.prefix}error: {e}", file=sys.stderr)
        return 2
    wall, cpu = time.time(), time.process_time()
    try:
        cfg, job, model, scaling = prepare(args)
    except UserError as e:  # a bad value, said in one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = plan_rows(args, cfg, job, model, scaling)
    if args.json:
        print(json.dumps(rows, indent=1, default=str))
        return 0
    print_header(args, cfg, model, rows[0])
    if args.layouts == "all":
        print(layouts_table(rows))
        report_fastest(rows)
    elif scaling:
        print(scaling_table(rows))
        print(scaling_terms_line())
        if args.plot:
            plot_scaling(rows, args.plot, f"{args.config}: {rows[0]['local_batch']} samples per "
                         f"GPU, {model.gpu.name}, {model.network.name}, compute factor "
                         f"{model.compute_factor:.2f}")
            print(f"plot: {args.plot}")
    else:
        print_job(job, rows)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    print(f"(dry run: {time.time() - wall:.0f} s wall, {time.process_time() - cpu:.0f} s CPU, "
          f"peak resident set {rss:.2f} GB)", file=sys.stderr)
    return 0


def prepare(args: Any) -> tuple[Any, Any, Any, list[int]]:
    """The config, the job (None for --layouts all without calibration: each layout is its
    own), the time model (calibrated if asked) and the scaling's GPU counts; a UserError
    for anything wrong with them."""
    from planning.fake_world import require_collectives_on_fake_tensors
    from planning.layouts import layouts
    from planning.machines import DEFAULT_NETWORK, gpu_named, network_named
    from planning.planned_job import PlannedJob
    from planning.predict import calibrated
    from planning.published import COMPUTE_FACTOR
    from planning.rates import read_machine_file
    from planning.time_model import LINK_EFFICIENCY, TimeModel
    from utils.errors import UserError

    cfg = read_config(args.yaml_config, args.config, flags=flags_given(args))
    gpu = gpu_named(args.gpu)
    network = network_named(args.network or DEFAULT_NETWORK[gpu.name])
    per_node = args.gpus_per_node or network.gpus_per_node
    # the published runs' calibration goes with the published rates; measured rates: 1
    factor = args.compute_factor or (1.0 if args.machine_file else COMPUTE_FACTOR)
    if not 0 < factor <= 100:
        raise UserError(f"--compute_factor {factor}: expected a positive number (1: the rates "
                        "as they are)")
    try:
        scaling = [int(n) for n in args.scaling.split(",")] if args.scaling else []
    except ValueError:
        scaling = [0]
    if scaling and min(scaling) < 1:
        raise UserError(f"--scaling {args.scaling}: expected GPU counts like 4,16,64")
    rates = read_machine_file(args.machine_file) if args.machine_file else None
    model = TimeModel(gpu, network, rates, factor, per_node,
                      args.link_efficiency or LINK_EFFICIENCY)
    if args.layouts == "all" and (args.gpus < 1 or not layouts(cfg, args.gpus)):
        raise UserError(f"config '{args.config}' has no layout on --gpus {args.gpus}: its "
                        f"global batch {cfg.global_batch_size} must divide among the "
                        "data-parallel ranks (or give --local_batch_size)")
    if args.layouts == "all" and not args.measured_samples_per_s:
        require_collectives_on_fake_tensors()
        return cfg, None, model, scaling
    job = PlannedJob(cfg, args.gpus, per_node)
    job.check_nodes()
    for n in scaling:
        PlannedJob(cfg.replace(local_batch_size=job.local_batch), n, per_node).check_nodes()
    # the job's own mistakes first, then what this PyTorch cannot do
    require_collectives_on_fake_tensors()
    if args.measured_samples_per_s:
        try:
            model = calibrated(job, model, args.measured_samples_per_s)
        except ValueError as e:  # outside what the compute factor can explain
            raise UserError(f"--measured_samples_per_s {args.measured_samples_per_s:g}: "
                            f"{e}") from None
    return cfg, job, model, scaling


def plan_rows(args: Any, cfg: Any, job: Any, model: Any, scaling: list[int]
              ) -> list[dict[str, Any]]:
    """The rows to print: every layout, the weak scaling, or the job's rank roles."""
    from planning.predict import job_rows, layout_rows, scaling_rows

    if args.layouts == "all":
        return layout_rows(cfg, args.gpus, model.gpus_per_node, model)
    if scaling:
        return scaling_rows(cfg, scaling, model.gpus_per_node, model, job.local_batch)
    return job_rows(job, model)


def print_header(args: Any, cfg: Any, model: Any, row: dict[str, Any]) -> None:
    from planning.layouts import model_summary

    print(f"dry run: config {args.config} ({model_summary(cfg)}), amp {cfg.amp_mode}; "
          f"{row['gpus']} x {model.gpu.name}, {model.gpus_per_node} per node "
          f"({model.network.name}); local batch {row['local_batch']}, global "
          f"{row['global_batch']}")
    ranks = row["tp"] * row["cp"] * row["h"] * row["w"] * row["ens"]
    per_sample = row["rank_flops"] * ranks / row["local_batch"]
    print(f"FLOPs per sample: {row['flops_per_sample'] / 1e12:.3g} T (the model's, "
          f"networks.training_flops, x the ensemble's members); rank {row['rank']}'s step: "
          f"{row['rank_flops'] / 1e12:.3g} TFLOP counted ({per_sample / 1e12:.3g} T per "
          f"sample over its model-parallel and ens ranks), {gb(row['rank_bytes'])} read "
          "and written")
    measured = model.calibrated_from
    how = (f", calibrated from {measured:g} samples/s" if measured else
           "" if args.compute_factor else " (1: not calibrated)" if args.machine_file else
           " (the tutorial's published runs: planning/published.py)")
    print(f"time model: rates {model.rates.source}; compute factor "
          f"{model.compute_factor:.3g}{how}; link efficiency {model.link_efficiency:g} "
          "(planning/time_model.py)")


def report_fastest(rows: list[dict[str, Any]]) -> None:
    from planning.layouts import PlannedLayout

    def label(r: dict[str, Any]) -> str:
        return PlannedLayout(**{k: r[k] for k in ("dp", "tp", "cp", "h", "w", "ens", "fsdp",
                                           "activation_checkpointing")}).label()

    best = next((r for r in rows if r["fastest"]), None)
    pick = next((r for r in rows if r["planner_pick"]), None)
    if best is None:
        print("nothing fits: more GPUs, a smaller local batch or a smaller model")
        return
    print(f"fastest that fits: {label(best)}, {best['samples_per_s']:,.1f} samples/s, "
          f"peak {best['peak_gb']:.1f} GB; the memory planner's rule picks {label(pick)} "
          f"({pick['samples_per_s']:,.1f} samples/s)")


if __name__ == "__main__":
    sys.exit(main())
