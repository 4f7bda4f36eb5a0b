"""Reading a variable of an ERA5 source a batch of times at a time (era5/source.py):
its `Piece` (the lazy array of one dataset, read in the store's own dimension order), what a
read holds in memory, and the `Budget` that bounds the bytes of chunks in flight across the
read threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from era5.source_files import Opened

# Bytes of chunks in flight at most (a request larger than this runs alone): at 0.25 degrees
# a batch of 8 times of a pressure-level variable decodes 8 chunks of 54 MB.
READ_BYTES = 2**30
SPAN_BYTES = 64 * 2**20  # a run of levels read whole up to this size (Source._read_fields)


@dataclass(eq=False)
class Piece:
    """One dataset's array of a variable: (time, [level,] latitude, longitude), lazy."""

    array: Any          # xarray.DataArray, its dimensions in the source's order
    levels: np.ndarray | None
    opened: Opened      # the dataset: where, its times (hours since 1970-01-01), span

    @property
    def where(self) -> str:
        return self.opened.where

    @property
    def plane_bytes(self) -> int:
        """Bytes of one time of one level."""
        sizes = self.array.sizes
        return self.array.nbytes // max(sizes.get("time", 1) * sizes.get("level", 1), 1)

    def read_bytes(self, times: int, levels: int = 1) -> int:
        """Bytes a read of `times` times and `levels` levels holds while it runs: the chunks
        it decodes (a chunk holds every level of a variable; compressed and decoded) and the
        selection."""
        array = self.array
        selected = times * levels * self.plane_bytes
        shape = array.encoding.get("chunks") or array.encoding.get("chunksizes")
        if shape and "time" in array.dims and len(shape) == array.ndim:
            t = array.dims.index("time")
            chunk = int(np.prod(shape)) * array.dtype.itemsize
            return max(times, shape[t]) * (chunk // max(shape[t], 1)) * 2 + selected
        return 2 * selected

    def read(self, index: dict[str, Any]) -> np.ndarray:
        """The selection `index` as (time, [level,] latitude, longitude): read in the
        store's order (WeatherBench-2's coarse grids put longitude first), then transposed
        in memory, which costs less than a transposed lazy read."""
        block = np.asarray(self.array.isel(index).values)
        order = ("time", "level", "latitude", "longitude") if self.levels is not None else (
            "time", "latitude", "longitude")
        return block.transpose([self.array.dims.index(d) for d in order])



class Budget:
    """Bytes in flight across threads: `take(n)` waits until n more fit under the limit
    (or nothing else is in flight), and gives them back when its block ends."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._cond = threading.Condition()

    @contextmanager
    def take(self, n: int) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
        try:
            yield
        finally:
            with self._cond:
                self.used -= n
                self._cond.notify_all()



def selection(index: np.ndarray) -> Any:
    """A slice for evenly spaced increasing indices (a strided read), else the indices."""
    if len(index) == 1:
        return slice(int(index[0]), int(index[0]) + 1)
    steps = np.diff(index)
    if (steps == steps[0]).all() and steps[0] > 0:
        return slice(int(index[0]), int(index[-1]) + 1, int(steps[0]))
    return index
