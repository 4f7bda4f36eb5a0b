"""Local replicas of WeatherBench-2's ERA5 stores, for timing and measuring the preparation.

    python -m bench.era5_replica OUT [--years 2016-2018] [--first 1959] [--last 2023]
    python -m bench.era5_replica OUT --grid 1440x721 --years 2018 --written 16

The 5.625-degree store (`build`) and, at full size, the 0.25-degree one (`build_quarter`).

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

The 0.25-degree replica (`build_quarter`) has the same time axis and variables on the
public store's 0.25-degree grid: `latitude` from 90 to -90 (721 rows, both poles),
`longitude` 0 .. 359.75 (1440), dimensions (time, level, latitude, longitude), one time per
chunk: a pressure-level chunk (1, 13, 721, 1440) is 54 MB, a single-level one 4.2 MB, as
the public store's. A year there is ~430 GB, so the data is only where a measurement reads:
the first `written` times of each year are written (compressed as Zarr's default does), and
every other chunk is absent and reads as zeros (no fill value: xarray would read one as
missing), so a whole year can be prepared from it. Its memory is the real store's: a read
decodes or fills whole chunks alike.
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


def new_store(out: str | Path, grid: str, times: np.ndarray):
    """A replica store of WeatherBench-2's `grid` ERA5 store at `out` (zarr format 2, as
    theirs), with its time coordinate."""
    import zarr

    root = zarr.open_group(str(out), mode="w", zarr_format=2)
    root.attrs.update({"description": f"replica of WeatherBench-2's {grid} ERA5 store "
                                      "(bench/era5_replica.py)"})
    # No fill value for coordinates: xarray would read a time of 0 hours as missing.
    root.create_array("time", data=times, chunks=(len(times),), fill_value=None, attributes={
        "_ARRAY_DIMENSIONS": ["time"], "units": "hours since 1959-01-01",
        "calendar": "proleptic_gregorian"})
    return root


def build(out: str | Path, years: list[int], first: str = FIRST, stop: str = STOP,
          days: int | None = None) -> Path:
    """Write the replica (module docstring) at `out`, with data in `years` (all of each, or
    its first `days` days); returns its path."""
    import zarr

    out = Path(out)
    coords = axes(first, stop)
    n = len(coords["time"])
    root = new_store(out, "64x32", coords["time"])
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


QUARTER = (721, 1440)


def build_quarter(out: str | Path, years: list[int], written: int = 16) -> Path:
    """The 0.25-degree replica (module docstring), with the first `written` times of each
    of `years` written; returns its path."""
    import zarr

    out = Path(out)
    rows, cols = QUARTER
    coords = axes()
    n = len(coords["time"])
    lat = np.linspace(90.0, -90.0, rows)
    lon = 0.25 * np.arange(cols)
    root = new_store(out, "1440x721", coords["time"])
    for name, values, units in (("level", coords["level"], "millibars"),
                                ("latitude", lat, "degrees_north"),
                                ("longitude", lon, "degrees_east")):
        root.create_array(name, data=values, fill_value=None, attributes={
            "_ARRAY_DIMENSIONS": [name], "units": units})
    arrays = {}
    for name, (units, _, _) in {**PRESSURE, **SINGLE}.items():
        levels = name in PRESSURE
        dims = ["time"] + (["level"] if levels else []) + ["latitude", "longitude"]
        shape = (n,) + ((len(LEVELS),) if levels else ()) + QUARTER
        # No fill value: an absent chunk reads as zeros (xarray would read a fill value as
        # missing, NaN, and the preparation refuses NaN).
        arrays[name] = root.create_array(name, shape=shape, chunks=(1, *shape[1:]),
                                         dtype="float32", fill_value=None, attributes={
                                             "_ARRAY_DIMENSIONS": dims, "units": units})
    start = np.datetime64(FIRST, "h")
    rng = np.random.default_rng(0)
    for year in years:
        lo = int(np.searchsorted(coords["time"], (np.datetime64(f"{year}-01-01T00", "h")
                                                  - start) / HOUR))
        for i in range(lo, lo + written):
            for name, (_, mean, spread) in {**PRESSURE, **SINGLE}.items():
                shape = arrays[name].shape[1:]
                smooth = np.cos(np.radians(lat))[:, None] * np.cos(np.radians(lon) + i)[None]
                noise = rng.standard_normal(shape, dtype=np.float32)
                arrays[name][i] = (mean + spread * (0.5 * smooth + 0.01 * noise)
                                   ).astype(np.float32)
    zarr.consolidate_metadata(str(out), zarr_format=2)
    return out


CLIMATOLOGY_CHUNKS = {"hour": 3, "dayofyear": 3, "level": 1}  # the public 0.25-degree store's


def build_climatology_quarter(out: str | Path, written: int = 1) -> Path:
    """A replica of WeatherBench-2's 0.25-degree climatology store (`era5-hourly-
    climatology/1990-2019_6h_1440x721.zarr`): every variable of the channels and
    `10m_wind_speed` on (hour, dayofyear, [level,] latitude, longitude), 6-hourly x 366
    days, chunks of 3 hours x 3 days x one level x the grid (37 MB). The first `written`
    chunks of days (hours 0-12) are written at the channels' levels; every other chunk reads
    as zeros."""
    import zarr

    out = Path(out)
    rows, cols = QUARTER
    lat = np.linspace(90.0, -90.0, rows)
    lon = 0.25 * np.arange(cols)
    root = zarr.open_group(str(out), mode="w", zarr_format=2)
    for name, values, units in (("hour", np.arange(0, 24, 6), ""),
                                ("dayofyear", np.arange(1, 367), ""),
                                ("level", np.asarray(LEVELS, dtype=np.int64), "millibars"),
                                ("latitude", lat, "degrees_north"),
                                ("longitude", lon, "degrees_east")):
        root.create_array(name, data=values, fill_value=None, attributes={
            "_ARRAY_DIMENSIONS": [name], **({"units": units} if units else {})})
    wind = {"10m_wind_speed": ("m s**-1", 6.0, 3.0)}
    smooth = np.cos(np.radians(lat))[:, None] * np.cos(np.radians(lon))[None]
    for name, (units, mean, spread) in {**PRESSURE, **SINGLE, **wind}.items():
        levels = name in PRESSURE
        dims = ["hour", "dayofyear"] + (["level"] if levels else []) + ["latitude",
                                                                        "longitude"]
        shape = (4, 366) + ((len(LEVELS),) if levels else ()) + QUARTER
        chunks = tuple(CLIMATOLOGY_CHUNKS.get(d, n) for d, n in zip(dims, shape, strict=True))
        array = root.create_array(name, shape=shape, chunks=chunks, dtype="float32",
                                  fill_value=None, attributes={"_ARRAY_DIMENSIONS": dims,
                                                               "units": units})
        block = (mean + 0.5 * spread * smooth).astype(np.float32)
        for d in range(written):
            for k in [LEVELS.index(v) for v in (50, 500, 850, 1000)] if levels else [None]:
                index = (slice(0, 3), slice(3 * d, 3 * d + 3)) + ((k,) if levels else ())
                array[index] = np.broadcast_to(block, (3, 3, *QUARTER))
    zarr.consolidate_metadata(str(out), zarr_format=2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--years", default="2016-2018", help="years whose chunks are written")
    p.add_argument("--first", default=FIRST[:10], help="first day of the time axis")
    p.add_argument("--stop", default=STOP[:10], help="day after the last of the time axis")
    p.add_argument("--grid", choices=("64x32", "1440x721"), default="64x32")
    p.add_argument("--written", type=int, default=16,
                   help="1440x721: times written at the start of each year")
    args = p.parse_args()
    a, _, b = args.years.partition("-")
    years = list(range(int(a), int(b or a) + 1))
    start = time.perf_counter()
    if args.grid == "1440x721":
        build_quarter(args.out, years, args.written)
    else:
        build(args.out, years, args.first + "T00", args.stop + "T00")
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
