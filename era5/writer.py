"""One year of ERA5 into the tutorial's HDF5 layout, streamed in batches of samples.

    <out>/<split>/<year>.h5   "fields" float32 (n, 20, H, W), one sample per chunk;
                              "latitude" (H,), "longitude" (W,) in degrees;
                              "time" (n,) hours since 1970-01-01 (every 6 h from 00 UTC
                              on 1 January: 1460 samples, 1464 in a leap year)
    <out>/stats/partial/<year>.npz   a training year's statistics sums (statistics.py)

A year is written to `<year>.h5.partial`, its attribute `complete` set last, and renamed to
`<year>.h5` only then (a training year's sums are saved before the rename): a file with
the final name is always whole. A batch is checked (era5/source.py: no NaN or
infinity) before it is written; a year that fails leaves no file behind. The attributes of
`fields` record every channel's name, units and what it was made from (`channel_names`,
`channel_units`, `channel_sources`), the definition of its relative humidity
(`rh_definition`: "ecmwf" or "wb2", data/humidity.py) and the source.

On a second run a year is skipped when its file is whole, was made from the same source
with the same options (the attribute holds them), has the expected number of samples, and
(training years) its sums are there; anything else is written again.

Per batch of B samples the source's fields (B x 20 x H0 x W0 float32, H0 x W0 the source
grid), their crop and block means are in memory at once; a year is never held whole.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from data.climatology import sample_times
from data.era5_names import CHANNEL_NAMES, CHANNELS
from data.grid import Grid, write_file_grid
from data.statistics import PartialSums
from era5.pieces import READ_BYTES
from era5.source import READ_THREADS, Source, year_times
from utils.errors import DataError

_sources: dict[tuple[str, str | None], Source] = {}  # opened once per process
BASE_BYTES = 400 * 2**20  # the interpreter, numpy, xarray, zarr, h5py: measured ~0.3 GB


@dataclass(frozen=True)
class Plan:
    """What every year of one preparation shares."""

    source: str
    out: str
    crop_rows: int | None = None
    coarsen: int = 1
    max_samples: int | None = None
    batch_size: int = 8
    years: tuple[int, int] = (1900, 2200)  # the first and last year of the preparation
    read_threads: int = READ_THREADS
    rh_definition: str | None = None  # None: the source's own (era5/source.py)

    def options(self) -> str:
        """The source and the options that decide a file's content, as one string (an
        option left at None is left out: files written before it existed still match)."""
        kept = {k: v for k, v in asdict(self).items()
                if k not in ("out", "batch_size", "years", "read_threads")
                and not (k == "rh_definition" and v is None)}
        return json.dumps(kept, sort_keys=True)

    def samples(self, year: int) -> int:
        n = len(year_times(year))
        return n if self.max_samples is None else min(n, self.max_samples)


@dataclass(frozen=True)
class YearResult:
    split: str
    year: int
    samples: int
    bytes: int
    seconds: float
    skipped: bool


def year_file(out: str | os.PathLike, split: str, year: int) -> Path:
    return Path(out) / split / f"{year}.h5"


def sums_file(out: str | os.PathLike, year: int) -> Path:
    return Path(out) / "stats" / "partial" / f"{year}.npz"


def is_complete(plan: Plan, split: str, year: int) -> bool:
    """Whether the year's file (and, for a training year, its sums) is whole and made by
    this plan (module docstring)."""
    path = year_file(plan.out, split, year)
    try:
        with h5py.File(path, "r") as f:
            fields = f["fields"]
            ok = (fields.attrs.get("complete") == plan.options()
                  and fields.shape[0] == plan.samples(year)
                  and "latitude" in f and "longitude" in f and "time" in f)
    except (OSError, KeyError):
        return False
    if ok and split == "train":
        sums = sums_file(plan.out, year)
        try:
            ok = PartialSums.load(sums).count == plan.samples(year)
        except (OSError, KeyError, ValueError):
            ok = False
    return ok


def open_source(plan: Plan) -> Source:
    """The plan's source, opened once per process for all the plan's years (until
    `forget_sources`: a new preparation in the same process opens it again)."""
    key = (plan.source, plan.rh_definition)
    if key not in _sources:
        first, last = plan.years
        _sources[key] = Source(plan.source, np.datetime64(f"{first}-01-01T00", "h"),
                               np.datetime64(f"{last + 1}-01-01T00", "h"),
                               plan.read_threads, plan.rh_definition)
    return _sources[key]


def forget_sources() -> None:
    _sources.clear()


def output_grid(plan: Plan, grid: Grid) -> Grid:
    """The grid after --crop_rows and --coarsen (block means of the coordinates)."""
    lat, lon = grid.latitude, grid.longitude
    rows = len(lat) if plan.crop_rows is None else plan.crop_rows
    if rows > len(lat):
        raise DataError(f"--crop_rows {rows}: {plan.source} has only {len(lat)} rows")
    k = plan.coarsen
    if rows % k or len(lon) % k:
        raise DataError(f"--coarsen {k} does not divide the {rows} x {len(lon)} grid"
                        + (f" (ERA5's 721 rows: add --crop_rows {rows - rows % k})"
                           if rows % k else ""))
    lat = lat[:rows].reshape(-1, k).mean(axis=1)
    return Grid(lat, lon.reshape(-1, k).mean(axis=1))


def transform(plan: Plan, fields: np.ndarray) -> np.ndarray:
    """Source fields (B, 20, rows, W0), already cut to --crop_rows (`Source.read`) -> the
    output grid: block means."""
    k = plan.coarsen
    if k == 1:
        return np.ascontiguousarray(fields, dtype=np.float32)
    B, C, H, W = fields.shape
    blocks = fields.reshape(B, C, H // k, k, W // k, k)
    return blocks.mean(axis=(3, 5), dtype=np.float64).astype(np.float32)


def prepare_year(plan: Plan, split: str, year: int,
                 report: Callable[[int], None] = lambda n: None) -> YearResult:
    """Write one year (module docstring); `report(n)` after every batch of n samples."""
    start = time.perf_counter()
    final = year_file(plan.out, split, year)
    if is_complete(plan, split, year):
        return YearResult(split, year, plan.samples(year), final.stat().st_size, 0.0, True)
    source = open_source(plan)
    grid = output_grid(plan, source.grid)
    times = source.select_year(year, plan.max_samples)
    n, (H, W) = len(times), grid.shape
    hours = (times - np.datetime64("1970-01-01T00", "h")).astype(np.int64)
    phase, hour = sample_times(hours, len(year_times(year)))
    sums = PartialSums.empty() if split == "train" else None
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + ".partial")
    try:
        with h5py.File(tmp, "w") as f:
            fields = _create_fields(f, plan, source, split, year, (n, H, W))
            write_file_grid(f, grid)
            f.create_dataset("time", data=hours, track_times=False).attrs["units"] = \
                "hours since 1970-01-01 00:00:00"
            for i in range(0, n, plan.batch_size):
                j = min(i + plan.batch_size, n)
                x = transform(plan, source.read(i, j, plan.crop_rows))  # no NaN, no inf
                fields[i:j] = x
                if sums is not None:
                    sums.add(x, phase[i:j], hour[i:j])
                report(j - i)
            fields.attrs["complete"] = plan.options()  # last: the file is whole
    except BaseException:
        tmp.unlink(missing_ok=True)  # nothing of a year that failed is left
        raise
    if sums is not None:
        sums_file(plan.out, year).parent.mkdir(parents=True, exist_ok=True)
        sums.save(sums_file(plan.out, year))
    os.replace(tmp, final)
    return YearResult(split, year, n, final.stat().st_size, time.perf_counter() - start,
                      False)


def _create_fields(f: h5py.File, plan: Plan, source: Source, split: str, year: int,
                   shape: tuple[int, int, int]) -> h5py.Dataset:
    """The `fields` dataset (one sample per chunk) and its attributes."""
    n, H, W = shape
    C = len(CHANNEL_NAMES)
    fields = f.create_dataset("fields", (n, C, H, W), dtype="f4", chunks=(1, C, H, W),
                              track_times=False)
    fields.attrs.update({
        "channel_names": list(CHANNEL_NAMES), "channel_units": [c.units for c in CHANNELS],
        "channel_sources": source.channel_sources, "rh_definition": source.rh_definition,
        "dt_hours": 6, "year": year,
        "split": split, "samples_per_year": len(year_times(year)), "source": plan.source,
        "crop_rows": plan.crop_rows or 0, "coarsen": plan.coarsen,
        "description": "ERA5, era5/prepare.py; row 0 = north"})
    return fields


def memory_per_worker(plan: Plan, source: Source, train: bool = True) -> int:
    """Bytes a process preparing a year holds at its peak, estimated from the source's grid
    and chunks: the chunks a batch decodes while it reads (at most READ_BYTES at a time, or
    the largest variable's), the fields read from them and the batch on the output grid, a
    training year's statistics sums (data/statistics.py), and the interpreter with its
    libraries. docs/real_era5.md compares it with the peak measured at 0.25 degrees."""
    B = plan.batch_size
    plane = source.grid.shape[0] * source.grid.shape[1] * 4
    spans: dict[int, tuple[Any, list[int]]] = {}
    for f in source.fields:
        piece, level = f.pieces[0]
        spans.setdefault(id(piece), (piece, []))[1].append(0 if level is None else level)
    reads = [p.read_bytes(B, max(levels) - min(levels) + 1) for p, levels in spans.values()]
    chunks = min(sum(reads), max(READ_BYTES, max(reads)))
    H, W = output_grid(plan, source.grid).shape
    C = len(CHANNEL_NAMES)
    fields = (len(source.fields) + C) * B * plane + (C * B * H * W * 8 if plan.coarsen > 1
                                                    else 0)
    sums = PartialSums.nbytes(C, H, W) + 3 * B * H * W * 8 if train else 0
    return int(chunks + fields + sums + BASE_BYTES)


def file_rh_definition(path: str | os.PathLike) -> str:
    """The definition of relative humidity a prepared year file records ("" if none)."""
    with h5py.File(path, "r") as f:
        return str(f["fields"].attrs.get("rh_definition", ""))


def file_grid(path: str | os.PathLike) -> Grid:
    """The grid recorded in a prepared year file."""
    with h5py.File(path, "r") as f:
        return Grid(f["latitude"][()], f["longitude"][()])
