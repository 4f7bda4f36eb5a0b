"""Earth2Studio's forecasts against inference.py's, field by field and lead by lead.

`inference.py --save_forecasts` writes WeatherBench-2's layout (evaluation/forecast_file.py:
its variable names and units, pressure levels, latitude ascending, members on
`realization`); an Earth2Studio workflow writes one array per variable id with dimensions
([ensemble,] time, lead_time, lat, lon), latitude as the model's (north to south). Both
become (time, [member,] lead, channel, lat, lon) arrays in the prepared files' units, rows
north to south. Their difference is relative: |ours - theirs| / max(|theirs|, std), the
value's own size, or the channel's standard deviation (the normalisation's) where the value
is smaller than that (a wind near zero), so that 1e-5 means 1e-5 of the field everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from data.era5_names import channel, wb2_units
from tools.earth2studio.names import EARTH2STUDIO_NAMES


def inference_forecasts(store: Any, channels: Sequence[str]) -> np.ndarray:
    """(time, [realization,] lead, C, H, W) float32 of a WeatherBench-2 forecast Dataset
    (an open xarray Dataset of inference.py's store), in the prepared files' units."""
    fields = []
    for name in channels:
        c = channel(name)
        if c is None:
            raise KeyError(f"channel {name} is not in the WeatherBench-2 table")
        da = store[c.variable]
        da = da.sel(level=c.level) if c.level is not None else da
        fields.append(da.values / np.float32(wb2_units(c.variable)[1]))
    return np.stack(fields, axis=-3)[..., ::-1, :].astype(np.float32)  # rows north to south


def earth2studio_forecasts(output: Any, channels: Sequence[str]) -> np.ndarray:
    """(time, [ensemble,] lead, C, H, W) float32 of an Earth2Studio workflow's output (an
    xarray Dataset: `XarrayBackend.root`, or a Zarr store opened with xarray)."""
    fields = []
    for name in channels:
        da = output[EARTH2STUDIO_NAMES[name]]
        if "ensemble" in da.dims:
            da = da.transpose("time", "ensemble", "lead_time", "lat", "lon")
        else:
            da = da.transpose("time", "lead_time", "lat", "lon")
        fields.append(da.values)
    return np.stack(fields, axis=-3).astype(np.float32)


def difference_by_lead(ours: np.ndarray, theirs: np.ndarray, stds: np.ndarray) -> np.ndarray:
    """The largest relative difference (module docstring) at each lead: (L+1,)."""
    if ours.shape != theirs.shape:
        raise ValueError(f"forecasts of shape {ours.shape} and {theirs.shape}")
    theirs = theirs.astype(np.float64)
    scale = np.maximum(np.abs(theirs), stds.astype(np.float64).reshape(-1, 1, 1))
    diff = np.abs(ours - theirs) / scale
    lead = diff.ndim - 4
    return diff.max(axis=tuple(a for a in range(diff.ndim) if a != lead))
