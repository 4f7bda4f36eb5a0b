"""Rollouts written as a Zarr dataset in WeatherBench-2's forecast layout, so that its own
evaluation (and anyone's xarray code) can read and score them.

    time                  initial time (datetime64), one per initial condition
    realization           an ensemble's member, 0 .. E - 1 (ensembles only: WeatherBench-2's
                          ensemble dimension)
    prediction_timedelta  lead time (timedelta64): 0 h (the initial state), 6 h, ...
    level                 hPa, for the pressure-level variables: the union of the levels
                          of the 20 channels (50, 500, 850, 1000); a level a variable does
                          not have is NaN (e.g. temperature at 1000 hPa)
    latitude              degrees north, ascending (as WeatherBench-2's evaluation wants
                          it; the HDF5 files run north to south)
    longitude             degrees east

Variables carry WeatherBench-2's names (data/era5_names.py: `geopotential`,
`2m_temperature`, ...) in its units (a `units` attribute each, `wb2_units`): geopotential in
m2/s2, relative humidity a fraction (the prepared files hold percent), with the definition
of the data's relative humidity in an `rh_definition` attribute (data/humidity.py).
Chunks hold one field of one initial condition and lead. The store is created once
(`create_store`, world rank 0) and every writing rank fills its initial conditions' `time`
slots, a few leads at a time (`write_forecasts`).
`wb2_arrays` turns fields into these variables, for the truth too (evaluation/truth_file.py).
"""

from __future__ import annotations

import numpy as np

from data.era5_names import CHANNELS, wb2_units
from data.grid import Grid
from data.humidity import DEFINITIONS

HOURS = np.timedelta64(1, "h")


def wb2_layout(channels: list[str]) -> tuple[dict[str, list[tuple[int, int | None]]], list[int]]:
    """{variable: [(channel index, level or None)]} of the channels in the table, and the
    sorted pressure levels."""
    table = {c.name: c for c in CHANNELS}
    variables: dict[str, list[tuple[int, int | None]]] = {}
    for i, name in enumerate(channels):
        if name in table:
            c = table[name]
            variables.setdefault(c.variable, []).append((i, c.level))
    levels = sorted({lev for entries in variables.values() for _, lev in entries
                     if lev is not None})
    return variables, levels


def create_store(path: str, init_hours: np.ndarray, lead_hours: list[int], grid: Grid,
                 channels: list[str], rh_definition: str = "", members: int = 0) -> None:
    """An empty store (metadata and coordinates) for len(init_hours) initial conditions
    (of `members` members each: a `realization` dimension; 0: a single forecast); its
    relative humidity records its definition (`humidity_attributes`)."""
    import dask.array as da
    import xarray as xr

    variables, levels = wb2_layout(channels)
    n, L1 = len(init_hours), len(lead_hours)
    H, W = grid.shape
    lead = (("realization",), (members,), (1,)) if members else ((), (), ())
    data = {}
    for variable, entries in variables.items():
        pressure = entries[0][1] is not None
        dims = ("time", *lead[0], "prediction_timedelta") + (("level",) if pressure else ()) + (
            "latitude", "longitude")
        shape = (n, *lead[1], L1) + ((len(levels),) if pressure else ()) + (H, W)
        chunks = (1, *lead[2], 1) + ((len(levels),) if pressure else ()) + (H, W)
        data[variable] = xr.Variable(dims, da.full(shape, np.nan, dtype=np.float32,
                                                   chunks=chunks),
                                       {"units": wb2_units(variable)[0],
                                        **humidity_attributes(variable, rh_definition)})
    coords = {
        "time": np.datetime64("1970-01-01T00", "ns") + np.asarray(init_hours) * HOURS,
        "prediction_timedelta": (np.asarray(lead_hours) * HOURS).astype("timedelta64[ns]"),
        "latitude": ("latitude", grid.latitude[::-1].copy(), {"units": "degrees_north"}),
        "longitude": ("longitude", grid.longitude.copy(), {"units": "degrees_east"}),
    }
    if members:
        coords["realization"] = np.arange(members, dtype=np.int64)
    if levels:
        coords["level"] = ("level", np.asarray(levels, dtype=np.int64), {"units": "hPa"})
    ds = xr.Dataset(data, coords=coords, attrs={
        "description": "forecasts in WeatherBench-2's layout: time = initial time"})
    ds.to_zarr(path, mode="w", compute=False, zarr_format=2, consolidated=True)


def humidity_attributes(variable: str, rh_definition: str) -> dict[str, str]:
    """The attributes that say which relative humidity a variable holds (data/humidity.py):
    `rh_definition` ("wb2" or "ecmwf"), and a description; none for other variables or an
    unknown definition."""
    if variable != "relative_humidity" or rh_definition not in DEFINITIONS:
        return {}
    return {"rh_definition": rh_definition,
            "comment": f"{DEFINITIONS[rh_definition]} relative humidity"}


def wb2_arrays(fields: np.ndarray, channels: list[str], leading: tuple[str, ...]
               ) -> dict[str, tuple[tuple[str, ...], np.ndarray]]:
    """{variable: (dims, values)} of `fields` (*leading, C, H, W) in the prepared files'
    units, rows north to south: WeatherBench-2's names and units, the pressure levels of
    each variable on the levels of all (NaN where it has none), latitude ascending."""
    variables, levels = wb2_layout(channels)
    fields = fields[..., ::-1, :]  # latitude ascending
    *lead, _, H, W = fields.shape
    out = {}
    for variable, entries in variables.items():
        factor = np.float32(wb2_units(variable)[1])
        if entries[0][1] is None:
            (c, _), = entries
            out[variable] = ((*leading, "latitude", "longitude"),
                             np.ascontiguousarray(fields[..., c, :, :] * factor,
                                                  dtype=np.float32))
            continue
        block = np.full((*lead, len(levels), H, W), np.nan, dtype=np.float32)
        for c, level in entries:
            block[..., levels.index(level), :, :] = fields[..., c, :, :] * factor
        out[variable] = ((*leading, "level", "latitude", "longitude"), block)
    return out


def write_forecasts(path: str, start: int, fields: np.ndarray, channels: list[str],
                    lead: int = 0) -> None:
    """Fill initial conditions start .. start + B - 1, leads lead .. lead + n - 1, with
    `fields`, (B, n, C, H, W) float32 in physical units, rows north to south (as the data),
    or an ensemble's (B, E, n, C, H, W) (every member): a few leads at a time, so that a
    batch's rollouts are never held whole."""
    import xarray as xr

    B, n = fields.shape[0], fields.shape[-4]
    leading = ("time", "realization", "prediction_timedelta") if fields.ndim == 6 else (
        "time", "prediction_timedelta")
    data = wb2_arrays(fields, channels, leading)
    xr.Dataset(data).to_zarr(path, region={"time": slice(start, start + B),
                                           "prediction_timedelta": slice(lead, lead + n)})
