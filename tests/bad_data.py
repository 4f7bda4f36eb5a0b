"""Real damage to real files, for the error tests: a NaN in a sample, a compressed chunk with
garbage in it, fields of another type, a flipped byte inside a checkpoint's tensor."""

from __future__ import annotations

import shutil
import struct
import zipfile
from pathlib import Path

import h5py
import numpy as np


def copy_data(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def set_value(path: Path, row: int, channel: int, value: float) -> None:
    """fields[row, channel, 1, 2] = value (inside every config's crop)."""
    with h5py.File(path, "r+") as f:
        f["fields"][row, channel, 1, 2] = value


def rewrite(path: Path, dtype: str = "f4", compression: str | None = None) -> np.ndarray:
    """Write `path`'s fields again as `dtype` (integers rounded), one sample per chunk,
    optionally compressed; returns the values as stored."""
    with h5py.File(path, "r") as f:
        x = f["fields"][...]
    if np.dtype(dtype).kind in "iu":
        x = np.round(x)
    x = x.astype(dtype)
    with h5py.File(path, "w") as f:
        f.create_dataset("fields", data=x, chunks=(1, *x.shape[1:]), compression=compression)
    return x


def damage_chunk(path: Path, row: int) -> None:
    """Garbage in the middle of the compressed chunk that holds sample `row`: the HDF5
    structure is intact, decompressing that chunk fails."""
    with h5py.File(path, "r") as f:
        info = f["fields"].id.get_chunk_info_by_coord((row, 0, 0, 0))
    with open(path, "r+b") as f:
        f.seek(info.byte_offset + info.size // 2)
        f.write(b"\xa5" * 32)


def flip_tensor_byte(path: Path) -> None:
    """Flip one byte inside the first tensor record of a torch.save file: the archive stays
    well-formed and torch.load reads it without complaint, only the record's CRC is wrong."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    raw = bytearray(Path(path).read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:
                                                    info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len  # the record's data
    raw[start + info.file_size // 2] ^= 0xFF
    Path(path).write_bytes(bytes(raw))


def first_batch_rows(params, rank: int, world: int) -> set[tuple[str, int]]:
    """(file name, row) of every field row that rank `rank` of `world` reads for its first
    training batch (epoch 1): inputs and targets."""
    from data.dataset import dataset_and_sampler

    ds, sampler = dataset_and_sampler(params, params.train_data_path, True, world, rank,
                                      batch_size=params.local_batch_size)
    sampler.set_epoch(1)
    rows = set()
    for index in list(sampler)[:sampler.batch_size]:
        file_idx, local = ds.locate(index)
        name = Path(ds.files[file_idx]).name
        rows |= {(name, local), (name, local + ds.dt)}
    return rows
