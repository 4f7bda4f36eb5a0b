"""The truth of saved forecasts, written as WeatherBench-2's ERA5 stores hold it, so that its
evaluation scores the forecasts on exactly their grid (`inference.py --save_truth PATH`).

WeatherBench-2's evaluation (`evaluation.open_source_files`) makes latitude increasing in
both stores and requires the forecast's latitude and longitude to equal the truth's to 1e-3
before it selects anything, so a forecast on a crop (`--crop_rows`) or block means
(`--coarsen`) of the public grid cannot be scored against the public store. This store holds
the test split's fields at every valid time of the forecasts, on the forecasts' grid:

    time        the valid times (datetime64), every one a forecast needs, in order
    level       hPa: the levels of the 20 channels (50, 500, 850, 1000); NaN where a
                variable has none
    latitude    degrees north, ascending (as the forecast store)
    longitude   degrees east

with WeatherBench-2's variable names and units (evaluation/forecast_file.py: `wb2_arrays`),
one time per chunk as its stores. Written by one process, a batch of times at a time.
"""

from __future__ import annotations

import numpy as np

from data.era5_names import wb2_units
from data.forecast import RolloutData
from data.grid import Grid
from evaluation.forecast_file import humidity_attributes, wb2_arrays, wb2_layout

HOUR = np.timedelta64(1, "h")


def write_truth(path: str, data: RolloutData, hours: np.ndarray, grid: Grid,
                channels: list[str], batch: int = 8) -> int:
    """Write the truth at every hour of `hours` (hours since 1970-01-01, any shape,
    repeats allowed) on `grid` (the forecasts'); returns the number of times written."""
    import xarray as xr

    hours = np.unique(np.asarray(hours, dtype=np.int64))
    variables, levels = wb2_layout(channels)
    coords = {"latitude": ("latitude", grid.latitude[::-1].copy(), {"units": "degrees_north"}),
              "longitude": ("longitude", grid.longitude.copy(), {"units": "degrees_east"})}
    if levels:
        coords["level"] = ("level", np.asarray(levels, dtype=np.int64), {"units": "hPa"})
    for start in range(0, len(hours), batch):
        when = hours[start:start + batch]
        fields = data.read_at(when)[:, :len(channels)]
        ds = xr.Dataset(wb2_arrays(fields, channels, ("time",)), coords={
            **coords, "time": np.datetime64("1970-01-01T00", "ns") + when * HOUR})
        for name in variables:
            ds[name].attrs.update({"units": wb2_units(name)[0],
                                   **humidity_attributes(name, data.rh_definition)})
        if start == 0:
            ds.attrs["description"] = ("truth at the forecasts' valid times, in WeatherBench-2's "
                                       "ERA5 layout (evaluation/truth_file.py)")
            encoding = {name: {"chunks": (1, *ds[name].shape[1:])} for name in ds.data_vars}
            ds.to_zarr(path, mode="w", zarr_format=2, consolidated=True, encoding=encoding)
        else:
            ds.to_zarr(path, append_dim="time", consolidated=True)
    return len(hours)
