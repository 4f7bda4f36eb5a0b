"""Synthetic ERA5-like data: a chaotic two-layer quasi-geostrophic planet written in the
tutorial's HDF5 layout, so the real-data loaders read it unchanged.

Layout (one file per "year", years of a split are consecutive chunks of one trajectory):
    <out>/{train,valid,test}/<year>.h5  "fields" float32 (N, 20, H, W), chunks (1, 20, H, W);
        "latitude" (H,) rows at 90 - 180 i / H degrees (north pole included, south pole not),
        "longitude" (W,) at 360 j / W; "time" (N,) hours since 1970-01-01 (labels: a synthetic
        year starts on 1 January and lasts samples_per_year samples)
    <out>/stats/global_means.npy, global_stds.npy (1, 20, 1, 1); time_means.npy (1, 20, H, W);
        climatology.npz (seasonal and diurnal harmonics, data/climatology.py);
        latitude.npy, longitude.npy

The planet and its dynamics are data/planet.py's. All years form one continuous trajectory
after the planet's spin-up: train years first, then valid, then test, so the splits never
share samples. A "year" file holds samples_per_year 6-hourly samples and one full seasonal
cycle (a real year is 1460 samples). The dynamics run on a grid of at most 48 x 96 (at least
32 x 64) and are interpolated spectrally to the output grid. Defaults: 64 x 128, 128 samples
per year (shortened 32-day years), 2 + 1 + 1 years.

Stochastic forcing (`--forcing Z`, off by default; data/planet.py): such data sets also store,
in their test years, the model state every sample was diagnosed from (`planet_state`), so
that ensembles can be branched at any test sample (data/perfect_ensemble.py).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import h5py
import numpy as np

from data.climatology import sample_times
from data.era5_names import CHANNEL_NAMES
from data.grid import write_file_grid
from data.planet import DT_HOURS, Planet, grid_of, orography
from data.statistics import PartialSums, write_stats

__all__ = ["generate", "main"]

FIRST_YEAR = 2016
SPLITS = ("train", "valid", "test")
_CORE_MAX = (48, 96)  # the dynamics' grid, whatever the output grid
_CORE_MIN = (32, 64)


def _expected_files(out: Path, years: dict[str, list[int]]) -> list[Path]:
    files = [out / split / f"{y}.h5" for split in SPLITS for y in years[split]]
    return files + [out / "stats" / n for n in (
        "global_means.npy", "global_stds.npy", "time_means.npy", "climatology.npz",
        "latitude.npy", "longitude.npy")]


def generate(out_dir: str | os.PathLike, img_size: tuple[int, int] = (64, 128),
             samples_per_year: int = 128, train_years: int = 2, valid_years: int = 1,
             test_years: int = 1, seed: int = 0, force: bool = False,
             forcing: float = 0.0) -> dict:
    """Write the synthetic data set; returns a summary (paths, sizes, seconds, skipped).
    `forcing`: the stochastic kick's z500 root mean square in m2/s2 (data/planet.py)."""
    h, w = (int(v) for v in img_size)
    if not forcing >= 0:
        raise ValueError(f"forcing must be >= 0 (m2/s2 of z500), got {forcing}")
    for name, val, low in (("img_size", min(h, w), 4), ("samples_per_year", samples_per_year, 2),
                           ("train_years", train_years, 1), ("valid_years", valid_years, 1),
                           ("test_years", test_years, 1)):
        if int(val) < low:
            raise ValueError(f"{name} must be >= {low}, got {val}")
    out = Path(out_dir)
    counts = {"train": train_years, "valid": valid_years, "test": test_years}
    years, first = {}, FIRST_YEAR
    for split in SPLITS:
        years[split] = list(range(first, first + counts[split]))
        first += counts[split]
    files = _expected_files(out, years)
    summary = {"out_dir": str(out), "files": [str(f) for f in files], "img_size": (h, w),
               "samples_per_year": samples_per_year, "years": years, "seed": seed,
               "forcing": forcing}
    if not force and all(f.exists() for f in files):
        with h5py.File(files[0], "r") as f:
            ds = f["fields"]
            found = (ds.shape, int(ds.attrs["seed"]), float(ds.attrs.get("forcing", 0.0)))
        if found != ((samples_per_year, len(CHANNEL_NAMES), h, w), seed, forcing):
            raise ValueError(f"{out} holds a different data set {found}; use --force")
        print(f"{out} is complete, nothing to do (use --force to regenerate)")
        return {**summary, "skipped": True, "seconds": 0.0}

    start = time.perf_counter()
    planet = Planet(min(max(h, _CORE_MIN[0]), _CORE_MAX[0]),
                    min(max(w, _CORE_MIN[1]), _CORE_MAX[1]), seed, samples_per_year, forcing)
    while planet.index < 0:  # spin up to the statistically stationary turbulent state
        planet.advance()
    land, orog = orography((h, w))
    stats = PartialSums.empty()
    for split in SPLITS:
        (out / split).mkdir(parents=True, exist_ok=True)
        for year in years[split]:
            _write_year(out / split / f"{year}.h5", planet, (h, w), land, orog, split, year,
                        samples_per_year, seed, stats if split == "train" else None)
    write_stats(out / "stats", stats, grid_of(h, w))
    seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {len(files)} files ({size / 1e6:.1f} MB) to {out} in {seconds:.1f} s")
    return {**summary, "skipped": False, "seconds": seconds, "bytes": size}


def _write_year(path: Path, planet: Planet, shape: tuple[int, int], land: np.ndarray,
                orog: np.ndarray, split: str, year: int, samples_per_year: int, seed: int,
                stats: PartialSums | None) -> None:
    """One year file, written under a temporary name and renamed when complete."""
    h, w = shape
    tmp = path.with_name(path.name + ".tmp")
    with h5py.File(tmp, "w") as f:
        ds = f.create_dataset("fields", (samples_per_year, len(CHANNEL_NAMES), h, w),
                              dtype="f4", chunks=(1, len(CHANNEL_NAMES), h, w),
                              track_times=False)
        ds.attrs.update({
            "channel_names": list(CHANNEL_NAMES), "dt_hours": DT_HOURS, "seed": seed,
            "year": year, "split": split, "first_sample_index": planet.index,
            "samples_per_year": samples_per_year,
            "description": "synthetic ERA5-like two-layer QG planet, row 0 = north",
        })
        state = None
        if planet.forcing > 0:  # stochastic: say so, and keep the test years' states
            ds.attrs["forcing"] = planet.forcing
            if split == "test":
                state = f.create_dataset(
                    "planet_state", (samples_per_year, *planet.state.shape),
                    dtype=planet.state.dtype, chunks=(1, *planet.state.shape),
                    track_times=False)
                state.attrs["grid"] = (planet.ny, planet.nx)
                state.attrs["description"] = (
                    "rfft2 of the dynamics' state (PV of both layers, two moisture tracers) "
                    "each sample was diagnosed from: data/perfect_ensemble.py branches it")
        write_file_grid(f, grid_of(h, w))
        # Time labels: 1 January of `year`, at the hour of day of the planet's diurnal cycle.
        jan1 = (np.datetime64(f"{year}-01-01T00", "h") - np.datetime64("1970-01-01T00", "h"))
        hours = (jan1.astype(np.int64) + (planet.index * DT_HOURS) % 24
                 + DT_HOURS * np.arange(samples_per_year, dtype=np.int64))
        f.create_dataset("time", data=hours, track_times=False).attrs.update(
            {"units": "hours since 1970-01-01 00:00:00"})
        phase, hour = sample_times(hours, samples_per_year)
        for i in range(samples_per_year):
            x = planet.diagnose((h, w), land, orog)
            ds[i] = x
            if state is not None:
                state[i] = planet.state
            if stats is not None:
                stats.add(x[None], phase[i:i + 1], hour[i:i + 1])
            planet.advance()
    os.replace(tmp, path)


def _positive_int(text: str) -> int:
    val = int(text)
    if val <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return val


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="datasets/synthetic", help="output directory")
    parser.add_argument("--img_size", type=_positive_int, nargs=2, default=(64, 128),
                        metavar=("H", "W"), help="output grid (full ERA5 size: 360 720)")
    parser.add_argument("--samples_per_year", type=_positive_int, default=128,
                        help="6-hourly samples in each year file (a real year is 1460)")
    for split, n in (("train", 2), ("valid", 1), ("test", 1)):
        parser.add_argument(f"--{split}_years", type=_positive_int, default=n)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--forcing", type=float, default=0.0, metavar="Z",
                        help="stochastic forcing: a random kick before every 6-hour step "
                        "whose z500 has a root mean square of Z m2/s2 (0: none, the "
                        "deterministic planet)")
    parser.add_argument("--force", action="store_true", help="regenerate even if complete")
    args = parser.parse_args(argv)
    try:
        generate(args.out, tuple(args.img_size), args.samples_per_year, args.train_years,
                 args.valid_years, args.test_years, args.seed, args.force, args.forcing)
    except ValueError as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
