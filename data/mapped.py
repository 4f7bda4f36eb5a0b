"""Zero-copy reads: a year file's samples as numpy views of the file, memory-mapped.

An HDF5 read copies the bytes twice before the loader sees them: the kernel copies them from
the page cache into HDF5's buffer, HDF5 into the array. When a sample is stored as plain
float32 bytes (no compression or other filter, native byte order, the tutorial's layouts:
contiguous, or chunked with whole samples per chunk) its bytes can be read where they lie:
`np.memmap` maps the file, and the normalisation reads the mapped pages directly (less than
half the CPU time of a read through h5py: docs/benchmarks.md).

`mapped(path)` says whether a file qualifies: every sample's byte range is
looked up once (HDF5's chunk index, or the contiguous offset) and checked to lie inside the
file; anything else (compression, other chunk shapes, a truncated file, unallocated chunks)
returns None and the loader reads through h5py as before, with its error messages.
"""

from __future__ import annotations

import os
from typing import Any

import h5py
import numpy as np

FLOAT32 = np.dtype("<f4")


class MappedFields:
    """Sample i of a file -> a read-only (C, H, W) float32 view of the mapped file."""

    def __init__(self, path: str, offsets: np.ndarray, sample_shape: tuple[int, ...]):
        self.path, self.offsets, self.sample_shape = path, offsets, sample_shape
        self._file = np.memmap(path, dtype=np.uint8, mode="r")
        self._count = int(np.prod(sample_shape))

    def sample(self, i: int) -> np.ndarray:
        start = int(self.offsets[i])
        return self._file[start:start + 4 * self._count].view(FLOAT32).reshape(
            self.sample_shape)


def sample_offsets(fields: Any) -> np.ndarray | None:
    """Byte offset of each sample in the file, or None when samples are not stored as
    whole, unfiltered float32 blocks."""
    n, *shape = fields.shape
    dsid = fields.id
    if fields.dtype != FLOAT32 or dsid.get_create_plist().get_nfilters() != 0:
        return None
    nbytes = 4 * int(np.prod(shape))
    if fields.chunks is None:  # contiguous: sample i at offset + i * nbytes
        base = dsid.get_offset()
        return None if base is None else base + nbytes * np.arange(n, dtype=np.int64)
    if tuple(fields.chunks) != (1, *shape) or dsid.get_num_chunks() != n:
        return None
    offsets = np.empty(n, dtype=np.int64)
    for k in range(n):
        info = dsid.get_chunk_info(k)
        if info.size != nbytes or info.filter_mask != 0:
            return None
        offsets[info.chunk_offset[0]] = info.byte_offset
    return offsets


def mapped_fields(path: str) -> MappedFields | None:
    """A MappedFields for the file's "fields" if it qualifies, else None."""
    try:
        with h5py.File(path, "r") as f:
            fields = f["fields"]
            offsets, shape = sample_offsets(fields), tuple(fields.shape[1:])
    except (OSError, KeyError, RuntimeError, ValueError):  # unreadable: h5py will say why
        return None
    if offsets is None or len(offsets) == 0:
        return None
    nbytes = 4 * int(np.prod(shape))
    if offsets.min() < 0 or offsets.max() + nbytes > os.path.getsize(path):
        return None  # a truncated file: h5py reads it and reports the damage
    return MappedFields(path, offsets, shape)


_cache: dict[tuple, MappedFields | None] = {}


def mapped(path: str) -> MappedFields | None:
    """`mapped_fields(path)`, once per process and file version (a mapping is not shared
    across fork: each loader worker maps the file itself)."""
    stat = os.stat(path)
    key = (os.getpid(), path, stat.st_mtime_ns, stat.st_size)
    if key not in _cache:
        _cache[key] = mapped_fields(path)
    return _cache[key]
