"""A local replica of WeatherBench-2's 5.625-degree ERA5 store, for timing the preparation.

    python -m bench.era5_replica OUT [--years 2016-2018] [--first 1959] [--last 2023]

The layout is the public store's (docs/real_era5.md, "Reading cost"):

  - `time` six-hourly from 1959-01-01 00 UTC to 2023-01-10 18 UTC (93,544 times), one time per
    chunk; `level` the 13 pressure levels 50 .. 1000 hPa; `latitude` ascending from -87.1875
    to 87.1875 (32 rows, no poles); `longitude` 0 .. 354.375 (64 columns);
  - dimensions ordered (time, level, longitude, latitude), as WeatherBench-2's regridded
    stores are;
  - the eleven variables the 20 channels need, plus extra ones the preparation must skip:
    `specific_humidity` and `vertical_velocity` on levels, `total_precipitation_6hr`, and
    `geopotential_at_surface` and `land_sea_mask` without a time axis;
  - Zarr format 2 with consolidated metadata.

Only the chunks of the `--years` asked for are written (the eleven variables the channels
need); every other chunk is absent and reads as the fill value (NaN), so the store has the
public one's metadata and time axis at a fraction of its size.
"""

from __future__ import annotations

import argparse
import time
import zlib
from pathlib import Path

import numpy as np

LEVELS = (50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000)
ROWS, COLS = 32, 64
FIRST, STOP = "1959-01-01T00", "2023-01-11T00"  # the public store's first time, end
SINGLE = {"10m_u_component_of_wind": ("m s**-1", 0.0, 6.0),
          "10m_v_component_of_wind": ("m s**-1", 0.0, 5.0),
          "2m_temperature": ("K", 278.0, 20.0),
          "surface_pressure": ("Pa", 96500.0, 9000.0),
          "mean_sea_level_pressure": ("Pa", 101100.0, 1200.0),
          "total_column_water_vapour": ("kg m**-2", 25.0, 15.0)}
PRESSURE = {"temperature": ("K", 240.0, 25.0),
            "u_component_of_wind": ("m s**-1", 5.0, 12.0),
            "v_component_of_wind": ("m s**-1", 0.0, 8.0),
            "geopotential": ("m**2 s**-2", 60000.0, 45000.0),
            "relative_humidity": ("1", 0.5, 0.3)}
EXTRA_TIMED = {"specific_humidity": ("kg kg**-1", True), "vertical_velocity": ("Pa s**-1", True),
               "total_precipitation_6hr": ("m", False)}
EXTRA_STATIC = {"geopotential_at_surface": "m**2 s**-2", "land_sea_mask": "1"}
HOUR = np.timedelta64(1, "h")


def axes(first: str = FIRST, stop: str = STOP) -> dict[str, np.ndarray]:
    """The coordinates: time (hours since 1959-01-01, int64), level, latitude, longitude."""
    start = np.datetime64(FIRST, "h")
    when = np.arange(np.datetime64(first, "h"), np.datetime64(stop, "h"), 6 * HOUR)
    step = 180.0 / ROWS
    return {"time": (when - start).astype(np.int64),
            "level": np.asarray(LEVELS, dtype=np.int64),
            "latitude": -90.0 + step / 2 + step * np.arange(ROWS),
            "longitude": 360.0 * np.arange(COLS) / COLS}


def _values(name: str, mean: float, spread: float, hours: np.ndarray, levels: int
            ) -> np.ndarray:
    """(T, [levels,] COLS, ROWS) float32: a smooth field with a daily and a yearly cycle and
    a little noise, distinct per variable (magnitudes like ERA5's)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    lon = np.radians(axes()["longitude"])[:, None]
    lat = np.radians(axes()["latitude"])[None, :]
    t = hours.astype(np.float64)[:, None, None]
    field = (np.cos(lat) * np.cos(lon - 2 * np.pi * t / 24.0)
             + 0.5 * np.sin(lat) * np.cos(2 * np.pi * t / 8766.0))
    if levels:
        field = field[:, None] * np.linspace(1.0, 0.6, levels)[None, :, None, None]
    noise = rng.standard_normal(field.shape, dtype=np.float32) * 0.05
    return (mean + spread * (0.5 * field + noise)).astype(np.float32)


def build(out: str | Path, years: list[int], first: str = FIRST, stop: str = STOP,
          days: int | None = None) -> Path:
    """Write the replica (module docstring) at `out`, with data in `years` (all of each, or
    its first `days` days); returns its path."""
    import zarr

    out = Path(out)
    coords = axes(first, stop)
    n = len(coords["time"])
    root = zarr.open_group(str(out), mode="w", zarr_format=2)
    root.attrs.update({"description": "replica of WeatherBench-2's 64x32 ERA5 store "
                                      "(bench/era5_replica.py)"})
    # No fill value for coordinates: xarray would read a time of 0 hours as missing.
    root.create_array("time", data=coords["time"], chunks=(n,), fill_value=None, attributes={
        "_ARRAY_DIMENSIONS": ["time"], "units": "hours since 1959-01-01",
        "calendar": "proleptic_gregorian"})
    for name in ("level", "latitude", "longitude"):
        units = {"level": "millibars", "latitude": "degrees_north",
                 "longitude": "degrees_east"}[name]
        root.create_array(name, data=coords[name], fill_value=None, attributes={
            "_ARRAY_DIMENSIONS": [name], "units": units})
    arrays = {}
    variables = [(k, u, True, True) for k, (u, *_) in PRESSURE.items()] + [
        (k, u, False, True) for k, (u, *_) in SINGLE.items()] + [
        (k, u, lev, True) for k, (u, lev) in EXTRA_TIMED.items()] + [
        (k, u, False, False) for k, u in EXTRA_STATIC.items()]
    for name, units, on_levels, timed in variables:
        dims = (["time"] if timed else []) + (["level"] if on_levels else []) + [
            "longitude", "latitude"]
        shape = tuple({"time": n, "level": len(LEVELS), "longitude": COLS,
                       "latitude": ROWS}[d] for d in dims)
        chunks = (1,) + shape[1:] if timed else shape
        arrays[name] = root.create_array(name, shape=shape, chunks=chunks, dtype="float32",
                                         fill_value=float("nan"), attributes={
                                             "_ARRAY_DIMENSIONS": dims, "units": units})
    start = np.datetime64(FIRST, "h")
    for year in years:
        lo, hi = (int(np.searchsorted(coords["time"], (np.datetime64(f"{y}-01-01T00", "h")
                                                         - start) / HOUR))
                  for y in (year, year + 1))
        hi = hi if days is None else min(hi, lo + 4 * days)
        hours = coords["time"][lo:hi]
        for name, (_, mean, spread) in {**SINGLE, **PRESSURE}.items():
            levels = len(LEVELS) if name in PRESSURE else 0
            arrays[name][lo:hi] = _values(name, mean, spread, hours, levels)
    zarr.consolidate_metadata(str(out), zarr_format=2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--years", default="2016-2018", help="years whose chunks are written")
    p.add_argument("--first", default=FIRST[:10], help="first day of the time axis")
    p.add_argument("--stop", default=STOP[:10], help="day after the last of the time axis")
    args = p.parse_args()
    a, _, b = args.years.partition("-")
    start = time.perf_counter()
    build(args.out, list(range(int(a), int(b or a) + 1)), args.first + "T00",
          args.stop + "T00")
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
