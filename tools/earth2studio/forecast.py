"""Run an exported package in Earth2Studio's own workflows, from this project's data, and
compare the forecasts with inference.py's (needs Earth2Studio: `make venv-earth2studio`).

    .venv-earth2studio/bin/python -m tools.earth2studio.forecast exports/cpu_quickstart \
        --data datasets/synthetic/test --like logs/cpu_quickstart/1CPU/00/forecast/forecasts.zarr
    .venv-earth2studio/bin/python -m tools.earth2studio.forecast exports/cpu_ens_finetune \
        --data datasets/synthetic_ens/test --time 2021-03-01T00 --nsteps 20 --ensemble 4 \
        --out e2s_ensemble.zarr

`--like STORE` (a store of `inference.py --save_forecasts`) takes its initial times, leads
and members, runs the same forecasts and prints, for every lead, the largest relative
difference from the store's (tools/earth2studio/compare.py); exit code 1 if one exceeds
--tolerance. Deterministic models run in `earth2studio.run.deterministic`; with members
(--ensemble E, or a store with `realization`) in `earth2studio.run.ensemble`: an ensemble
model's members differ by their noise (the zero perturbation), a deterministic model's by
inference.py's perturbed initial conditions. `--out` writes Earth2Studio's Zarr store.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

TOLERANCE = 1e-5  # relative (tools/earth2studio/compare.py)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("package", help="a package directory (python -m tools.export_earth2studio)")
    p.add_argument("--data", required=True, help="a split of the data: initial conditions")
    p.add_argument("--like", help="inference.py's --save_forecasts store: same forecasts, "
                                  "compared")
    p.add_argument("--time", nargs="+", help="initial times (without --like)")
    p.add_argument("--nsteps", type=int, help="steps (without --like)")
    p.add_argument("--ensemble", type=int, default=0, help="members (0: deterministic)")
    p.add_argument("--out", help="Earth2Studio's Zarr store of the forecasts")
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    args = p.parse_args(argv)
    if args.like is None and (args.time is None or args.nsteps is None):
        p.error("give --like STORE, or --time and --nsteps")
    return args


def run_workflow(model: Any, source: Any, times: np.ndarray, nsteps: int, members: int,
                 io: Any) -> Any:
    """Earth2Studio's deterministic workflow, or its ensemble workflow for `members` > 0,
    on the CPU; returns `io`."""
    from earth2studio import run
    from earth2studio.perturbation import Zero

    from tools.earth2studio.prognostic import InitialConditionPerturbation

    if not members:
        return run.deterministic(list(times), nsteps, model, source, io, device="cpu",
                                 verbose=False)
    perturbation = Zero() if model.package.ensemble_size > 1 else \
        InitialConditionPerturbation(model)
    return run.ensemble(list(times), nsteps, members, model, source, io, perturbation,
                        device="cpu", verbose=False)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import xarray as xr
    from earth2studio.io import XarrayBackend, ZarrBackend

    from tools.earth2studio.compare import (
        difference_by_lead,
        earth2studio_forecasts,
        inference_forecasts,
    )
    from tools.earth2studio.prognostic import Forecaster
    from tools.earth2studio.source import SplitSource, as_times

    model = Forecaster.from_pretrained(args.package)
    source = SplitSource(args.data)
    like = xr.open_zarr(args.like) if args.like else None
    if like is not None:
        times = like["time"].values
        nsteps = like.sizes["prediction_timedelta"] - 1
        members = like.sizes.get("realization", 0)
    else:
        times, nsteps, members = as_times(args.time), args.nsteps, args.ensemble
    io = ZarrBackend(args.out, backend_kwargs={"overwrite": True}) if args.out \
        else XarrayBackend()
    start = time.perf_counter()
    run_workflow(model, source, times, nsteps, members, io)
    seconds = time.perf_counter() - start
    print(f"Earth2Studio's {'ensemble' if members else 'deterministic'} workflow: "
          f"{model} from {len(times)} initial times, {nsteps} steps"
          + (f", {members} members" if members else "") + f", in {seconds:.1f} s"
          + (f"; written to {args.out}" if args.out else ""))
    if like is None:
        return 0
    output = xr.open_zarr(args.out) if args.out else io.root
    channels = model.package.channels
    ours = inference_forecasts(like, channels)
    theirs = earth2studio_forecasts(output, channels)
    worst = difference_by_lead(theirs, ours, model.package.stds)
    print("Largest relative difference from inference.py's forecasts, by lead: "
          + ", ".join(f"{d:.1e}" for d in worst))
    print(f"max {worst.max():.1e} over {len(worst)} leads, {len(channels)} channels"
          + (f", {members} members" if members else "") + ": "
          + ("equal" if worst.max() <= args.tolerance else "DIFFERENT")
          + f" to {args.tolerance:g}")
    return 0 if worst.max() <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
