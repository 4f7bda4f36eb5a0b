"""The tutorial's published runs beside the time model's predictions (docs/scaling.md).

    python -m bench.published_runs                              # calibrated on one run
    python -m bench.published_runs --calibrate_on sc25-short-bf16 --json
    python -m bench.published_runs --machine_file logs/gpu_check/<run>/machine.json

Dry-runs the step of every published run (planning/published.py: config, flags, GPU count),
calibrates the time model's compute factor on one of them (`--calibrate_on`, default the
SC24 edition's one-GPU bf16 run), and prints each run's published samples/s, the model's
prediction (the step, its communication and its input pipeline) and the error (0 inside the
published range). About a minute and a half of CPU: seven dry-run traces.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from planning.published import CALIBRATED_ON, PUBLISHED

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibrate_on", default=CALIBRATED_ON,
                   choices=[r.key for r in PUBLISHED], help="the run the model is fitted to")
    p.add_argument("--machine_file", default=None,
                   help="measured rates of an A100 40 GB (make gpu-check); default: "
                        "planning/rates.py's published ones")
    p.add_argument("--json", action="store_true", help="print a JSON list instead")
    return p.parse_args(argv)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| edition | run | GPUs | published samples/s | model | error |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lo, hi = r["published"]
        published = f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"
        gpu = "" if r["gpu"] == "a100-40gb" else f" ({r['gpu'].upper().replace('-', ' ')})"
        mark = " (calibrated on)" if r["calibrated_on"] else ""
        lines.append(f"| {r['edition']} | {r['what']}{gpu}{mark} | {r['gpus']} | "
                     f"{published} | {r['predicted']:.1f} | {r['error']:+.0%} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from planning.fake_world import require_collectives_on_fake_tensors
    from planning.machines import GPUS, NETWORKS
    from planning.published import calibrated_model, comparison, trace_runs
    from planning.rates import read_machine_file
    from planning.time_model import TimeModel
    from utils.errors import UserError

    try:
        rates = read_machine_file(args.machine_file) if args.machine_file else None
        require_collectives_on_fake_tensors()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    traces = trace_runs()
    model = calibrated_model(TimeModel(GPUS["a100-40gb"], NETWORKS["perlmutter"], rates),
                             traces, args.calibrate_on)
    rows = comparison(model, traces)
    if args.json:
        print(json.dumps({"compute_factor": model.compute_factor,
                          "rates": model.rates.source, "rows": rows}, indent=1))
        return 0
    print(f"time model: rates {model.rates.source}; compute factor "
          f"{model.compute_factor:.3g}, calibrated on {args.calibrate_on}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
