"""Small ERA5 sources made in the tests, in exactly the public layouts, from known fields.

    wb2_zarr(path, ...)   a WeatherBench-2 / ARCO-ERA5 Zarr store: long names, `level` (hPa),
                          `latitude` descending with poles (ARCO, WB2 0.25 deg) or ascending
                          without poles (WB2's coarse equiangular grids), hourly or 6-hourly
    cds_netcdf(dir, ...)  CDS downloads: one single-level and one pressure-level NetCDF file
                          per year, short names, `valid_time` + `pressure_level` (new CDS) or
                          `time` + `level` (older files)

Every value is `known(channel, hours since 1970, latitude, longitude)`, so a test can say
which channel, row, column and sample a number in the prepared files must be.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data.era5_names import CHANNEL_NAMES, CHANNELS

EPOCH = np.datetime64("1970-01-01T00", "h")
HOUR = np.timedelta64(1, "h")


def known(name: str, hours: np.ndarray, lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    """(T, H, W) float32 values of a channel: distinct per channel, row, column and time,
    with a daily and a yearly cycle (for the climatology) and exact in float32."""
    c = CHANNEL_NAMES.index(name)
    t = np.asarray(hours, dtype=np.float64)[:, None, None]
    day = np.sin(2 * np.pi * t / 24.0)
    year = np.cos(2 * np.pi * t / (24.0 * 365.25))
    values = (100.0 * (c + 1) + np.asarray(lat)[None, :, None] / 8.0
              + np.asarray(lon)[None, None, :] / 64.0 + 2.0 * day + 3.0 * year
              + (t % 97.0) / 16.0)
    return values.astype(np.float32)


def grid(rows: int, cols: int, ascending: bool = False, poles: bool = True
         ) -> tuple[np.ndarray, np.ndarray]:
    """Latitudes (with both poles, or cell centres without) and longitudes from 0."""
    if poles:
        lat = np.linspace(90.0, -90.0, rows)
    else:
        step = 180.0 / rows
        lat = 90.0 - step / 2 - step * np.arange(rows)
    lon = 360.0 * np.arange(cols) / cols
    return (lat[::-1].copy() if ascending else lat), lon


def times(years: list[int], step_hours: int, days: int | None = None) -> np.ndarray:
    """Every `step_hours` from 00 UTC on 1 January of each year, all year or `days` days."""
    out = []
    for y in years:
        start = np.datetime64(f"{y}-01-01T00", "h")
        end = (start + days * 24 * HOUR) if days else np.datetime64(f"{y + 1}-01-01T00", "h")
        out.append(np.arange(start, end, step_hours * HOUR))
    return np.concatenate(out)


def _variables(when: np.ndarray, lat: np.ndarray, lon: np.ndarray, short: bool,
               skip: tuple[str, ...] = ()) -> tuple[dict, dict, list[int]]:
    """{name: (dims, values, attrs)} of the single-level and the pressure-level variables."""
    hours = (when - EPOCH).astype(np.int64)
    levels = sorted({c.level for c in CHANNELS if c.level is not None})
    single, pressure = {}, {}
    for c in CHANNELS:
        if c.name in skip:
            continue
        name = c.short if short else c.variable
        attrs = {"units": c.units, "long_name": c.variable.replace("_", " ")}
        if c.level is None:
            single[name] = (("time", "latitude", "longitude"), known(c.name, hours, lat, lon),
                            attrs)
            continue
        if name not in pressure:
            pressure[name] = (("time", "level", "latitude", "longitude"),
                              np.full((len(when), len(levels), len(lat), len(lon)), np.nan,
                                      dtype=np.float32), attrs)
        pressure[name][1][:, levels.index(c.level)] = known(c.name, hours, lat, lon)
    return single, pressure, levels


def wb2_zarr(path: Path, years: list[int], rows: int = 7, cols: int = 12,
             step_hours: int = 6, days: int | None = None, ascending: bool = False,
             poles: bool = True, skip: tuple[str, ...] = (), drop_times: int = 0,
             chunk_time: int = 24) -> Path:
    """A WeatherBench-2 / ARCO-ERA5 style store (module docstring); `skip` leaves channels
    out (a single-level variable, or a level of a pressure-level one), `drop_times`
    removes that many times from the middle (a gap). The public stores chunk one time per
    chunk; `chunk_time` times per chunk keep the tests' small stores quick to write."""
    import xarray as xr

    lat, lon = grid(rows, cols, ascending, poles)
    when = times(years, step_hours, days)
    if drop_times:
        mid = len(when) // 2
        when = np.delete(when, np.arange(mid, mid + drop_times))
    single, pressure, levels = _variables(when, lat, lon, short=False, skip=skip)
    ds = xr.Dataset({**single, **pressure}, coords={
        "time": when.astype("datetime64[ns]"),
        "level": ("level", np.asarray(levels, dtype=np.int64), {"units": "millibars"}),
        "latitude": ("latitude", lat.astype(np.float32), {"units": "degrees_north"}),
        "longitude": ("longitude", lon.astype(np.float32), {"units": "degrees_east"}),
    })
    if any(c.level is not None and c.name in skip for c in CHANNELS):
        # a level missing from the store: keep only the levels every variable has
        ds = ds.sel(level=[lv for lv in levels
                           if not any(c.level == lv and c.name in skip for c in CHANNELS)])
    chunks = {"time": chunk_time, "level": len(ds.level), "latitude": rows, "longitude": cols}
    ds = ds.chunk({k: v for k, v in chunks.items() if k in ds.dims})
    ds.to_zarr(path, mode="w", zarr_format=2, consolidated=True)
    return path


def cds_netcdf(directory: Path, years: list[int], rows: int = 7, cols: int = 12,
               new_names: bool = True, pressure_rows: int | None = None) -> Path:
    """CDS-style NetCDF files, 6-hourly, whole years (module docstring); `pressure_rows`
    puts the pressure-level file on another grid (mixed grids)."""
    import xarray as xr

    directory.mkdir(parents=True, exist_ok=True)
    time_name, level_name = ("valid_time", "pressure_level") if new_names else ("time", "level")
    for year in years:
        when = times([year], 6)
        for kind, n_rows in (("single", rows), ("pressure", pressure_rows or rows)):
            lat, lon = grid(n_rows, cols)
            single, pressure, levels = _variables(when, lat, lon, short=True)
            data = single if kind == "single" else pressure
            coords = {"time": when.astype("datetime64[ns]"),
                      "latitude": ("latitude", lat, {"units": "degrees_north"}),
                      "longitude": ("longitude", lon, {"units": "degrees_east"})}
            if kind == "pressure":
                coords["level"] = ("level", np.asarray(levels, dtype=np.float64),
                                   {"units": "hPa"})
            ds = xr.Dataset(data, coords=coords).rename(
                {k: v for k, v in (("time", time_name), ("level", level_name))
                 if k in coords})
            if new_names:
                ds = ds.assign_coords(number=0, expver=("valid_time", ["0001"] * len(when)))
            ds.to_netcdf(directory / f"era5_{kind}_{year}.nc")
    return directory
