"""A split of this project's data (<dir>/<year>.h5, the ERA5 layout) as an Earth2Studio data
source: initial conditions for its workflows from the files our inference reads.

    source = SplitSource("datasets/synthetic/test")
    da = source(np.array(["2021-01-02T06"], dtype="datetime64[ns]"), ["u10m", "z500"])
    # xarray.DataArray (time, variable, lat, lon), physical units, Earth2Studio's names

Earth2Studio's `DataSource` protocol is a call (and its async twin `fetch`) that returns a
DataArray with dimensions [time, variable, lat, lon] for the times and variable ids asked
for. The sample times are the files' own (`time`, hours since 1970; data/forecast.py), the
grid the files' recorded one (data/grid.py), whole (a model on a crop of it takes its rows
and columns: Earth2Studio's workflows select them). Needs xarray, not Earth2Studio.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import h5py
import numpy as np

from data.era5_names import CHANNEL_NAMES
from data.forecast import file_times
from data.grid import read_file_grid
from tools.earth2studio.names import EARTH2STUDIO_NAMES
from utils.errors import DataError

EPOCH = np.datetime64("1970-01-01T00", "ns")
HOUR = np.timedelta64(1, "h")


def as_times(time: Any) -> np.ndarray:
    """A datetime, np.datetime64, string or a sequence of them -> datetime64[ns] array."""
    if isinstance(time, (str, datetime, np.datetime64)):
        time = [time]
    return np.asarray([np.datetime64(t, "ns") for t in time], dtype="datetime64[ns]")


def hours_since_1970(times: np.ndarray) -> np.ndarray:
    """datetime64 -> whole hours since 1970-01-01 (int64): the key of a sample's time in the
    files and of an ensemble member's noise (networks/ensemble.py)."""
    delta = np.asarray(times, dtype="datetime64[ns]") - EPOCH
    if (delta % HOUR != np.timedelta64(0, "ns")).any():
        raise DataError(f"times {times} are not whole hours")
    return (delta // HOUR).astype(np.int64)


class SplitSource:
    """Earth2Studio `DataSource` over the year files in `directory`."""

    def __init__(self, directory: str):
        self.directory = directory
        self.files = sorted(glob.glob(os.path.join(directory, "*.h5")))
        if not self.files:
            raise DataError(f"{directory}: no <year>.h5 files (a split of the ERA5 layout: "
                            "train, valid or test of a prepared data set)")
        self._place: dict[int, tuple[str, int]] = {}
        for path in self.files:
            with h5py.File(path, "r") as f:
                n, channels, *shape = f["fields"].shape
                for row, hours in enumerate(file_times(path, n)[0]):
                    self._place[int(hours)] = (path, row)
                if path == self.files[0]:
                    self.grid = read_file_grid(f, path, tuple(shape))
                    names = [v.decode() if isinstance(v, bytes) else str(v)
                             for v in f["fields"].attrs.get("channel_names", [])]
        names = names if len(names) == channels else list(CHANNEL_NAMES[:channels])
        self.channel_of = {EARTH2STUDIO_NAMES[c]: i for i, c in enumerate(names)
                           if c in EARTH2STUDIO_NAMES}
        self._open: dict[str, h5py.File] = {}

    def __call__(self, time: Any, variable: str | Sequence[str]) -> Any:
        """(time, variable, lat, lon) DataArray of the samples at `time` (whole hours, each
        in the files), variables by Earth2Studio id, physical units, float32."""
        import xarray as xr

        times = as_times(time)
        variables = [variable] if isinstance(variable, str) else [str(v) for v in variable]
        missing = [v for v in variables if v not in self.channel_of]
        if missing:
            raise DataError(f"{self.directory} has no variable {missing[0]} (it has "
                            f"{', '.join(self.channel_of)})")
        channels = [self.channel_of[v] for v in variables]
        out = np.empty((len(times), len(channels), *self.grid.shape), dtype=np.float32)
        for i, hours in enumerate(hours_since_1970(times)):
            if int(hours) not in self._place:
                raise DataError(f"{self.directory} has no sample at {times[i]}")
            path, row = self._place[int(hours)]
            fields = self._fields(path)
            for j, c in enumerate(channels):  # h5py reads one channel per call in order
                out[i, j] = fields[row, c]
        return xr.DataArray(out, dims=("time", "variable", "lat", "lon"), coords={
            "time": times, "variable": np.asarray(variables),
            "lat": self.grid.latitude, "lon": self.grid.longitude})

    async def fetch(self, time: Any, variable: str | Sequence[str]) -> Any:
        """The async form of the call (Earth2Studio's protocol has both)."""
        return self(time, variable)

    def times(self) -> np.ndarray:
        """Every sample time of the split, datetime64[ns], in order."""
        return EPOCH + np.asarray(sorted(self._place), dtype=np.int64) * HOUR

    def _fields(self, path: str) -> h5py.Dataset:
        if path not in self._open:
            self._open[path] = h5py.File(path, "r")
        return self._open[path]["fields"]

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()
