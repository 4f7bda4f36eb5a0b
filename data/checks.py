"""Bad data named precisely: fields that are not float32, samples that cannot be read, and
the sample behind a NaN/inf training loss (statistics that cannot normalise are named where
they are read, data/statistics.py).

Used by data/loader.py (and so by the DALI loader, which reads through the same
dataset) and by the run guard. Everything here costs nothing while the data are good: a
batch is read again only after its loss went NaN/inf.
"""

from __future__ import annotations

import copy
import itertools
import logging
from typing import Any

import h5py
import numpy as np

from data.era5_names import channel_label
from data.statistics import first_bad, nan_or_inf
from utils.errors import DataError

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- reading

_noticed: set[str] = set()  # stored types already reported by this process


def check_dtypes(files: list[str]) -> None:
    """Integer and float64 `fields` are read as float32 (one notice per stored type); other
    types (strings, compounds, complex) cannot be fields: DataError."""
    converted: dict[str, list[str]] = {}
    for path in files:
        with h5py.File(path, "r") as f:
            dtype = f["fields"].dtype
        if dtype.kind not in "iuf":
            raise DataError(f"{path}: 'fields' has type {dtype}, expected float32 "
                            "(integers and other floats are converted)")
        if dtype != np.float32:
            converted.setdefault(str(dtype), []).append(path)
    for dtype, paths in converted.items():
        if dtype not in _noticed:
            _noticed.add(dtype)
            more = f" and {len(paths) - 1} more file(s)" if len(paths) > 1 else ""
            log.info(f"Notice: 'fields' are {dtype}, not float32, in {paths[0]}{more}: "
                     "read as float32 (by the PyTorch and the DALI loader alike)")


class FieldsReader:
    """One file's 'fields' as the loaders read them: float32 whatever the stored type (the
    PyTorch and DALI loaders give the same batches), and a failed read (a damaged
    compressed chunk, a truncated file) a DataError naming the file and the sample."""

    def __init__(self, fields: h5py.Dataset, path: str):
        self.path = path
        self.shape = fields.shape
        # astype converts inside HDF5 while reading: no float64 copy of the sample.
        self._read = fields if fields.dtype == np.float32 else fields.astype(np.float32)

    def __getitem__(self, key: Any) -> np.ndarray:
        try:
            return self._read[key]
        except OSError as e:
            sample = key[0] if isinstance(key, tuple) else key
            if isinstance(sample, slice):  # a read of several samples: find the bad one
                rest = key[1:] if isinstance(key, tuple) else ()
                for i in range(*sample.indices(self.shape[0])):
                    self[(i, *rest)]
            raise DataError(f"{self.path}: cannot read sample {sample} of 'fields' "
                            f"({str(e).splitlines()[0]}): the file is damaged; copy it "
                            "again from its source, or regenerate it") from None


# ----------------------------------------------------------------------------- a bad batch

class BatchScan:
    """Finds the sample behind a NaN/inf training loss by reading its batch again.

    The batch of (epoch, b) on this rank is positions b * B .. (b + 1) * B of the shard
    sampler's order for that epoch, which depends only on (seed, epoch): nothing needs to
    be remembered while training runs.
    """

    def __init__(self, dataset: Any, sampler: Any):
        self.dataset, self.sampler = dataset, sampler

    def indices(self, epoch: int, batch: int) -> list[int]:
        sampler = copy.copy(self.sampler)  # set_epoch on a copy: the loader's stays put
        sampler.set_epoch(epoch)
        size = sampler.batch_size
        return list(itertools.islice(iter(sampler), batch * size, (batch + 1) * size))

    def find(self, epoch: int, batch: int) -> tuple[str | None, float | None]:
        """(the first non-finite value of that batch, described by file, sample and
        channel, or None; the largest |normalised value| of the batch)."""
        ds, largest = self.dataset, 0.0
        for index in self.indices(epoch, batch):
            file_idx, local = ds.locate(index)
            inp, tar = ds.read_pair(index)
            for row, raw in ((local, inp), (local + ds.dt, tar)):
                where = f"{ds.files[file_idx]}: sample {row} of 'fields'"
                bad = ~np.isfinite(raw)
                if bad.any():
                    c, n = first_bad(bad)
                    return (f"{where}, {channel_label(c)}, has {n} {nan_or_inf(raw[c])} "
                            "value(s)"), None
                with np.errstate(over="ignore"):
                    normalised = (raw - ds.means) / ds.stds
                bad = ~np.isfinite(normalised)
                if bad.any():
                    c, n = first_bad(bad)
                    return (f"{where}, {channel_label(c)}, has {n} value(s) too large for "
                            "float32 once normalised"), None
                largest = max(largest, float(np.abs(normalised).max()))
        return None, largest
