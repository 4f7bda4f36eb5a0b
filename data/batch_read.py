"""Read a whole batch at once: few HDF5 calls, normalisation vectorised over the batch.

The PyTorch DataLoader hands `ERA5Dataset.__getitems__` the batch's sample indices; this
module turns them into two (B, C, H, W) float32 arrays:
* consecutive indices in one file form a run; a run of n samples needs input rows
  [t, t + n) and target rows [t + dt, t + dt + n), which for n >= dt is ONE hyperslab
  [t, t + n + dt) (a shuffled training batch: one read of the pair (t, t + dt) per sample;
  a validation batch: one read for the whole batch), else two;
* files that store samples as plain float32 bytes are memory-mapped (data/mapped.py)
  and normalised where they lie, with no read copy; other files are read with hyperslabs;
* the normalisation writes the rows read into the batch: (x - mean) / std as a subtraction
  out of the rows read and one in-place division of the whole batch.
Per sample, the per-sample path makes 2 HDF5 reads, 4 numpy calls and a collate copy; this
makes 1 read, and 2 passes over the batch. The arithmetic is the same IEEE float32
(x - mean) / std, so batches are bit-identical to `ERA5Dataset.__getitem__`'s and to the
DALI loader's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from data.mapped import mapped


class Run(NamedTuple):
    """`n` consecutive samples of file `file`, from local index `start`, at batch row `row`."""
    file: int
    start: int
    n: int
    row: int


def runs(dataset: Any, indices: list[int]) -> list[Run]:
    """The batch's indices grouped into runs of consecutive samples within one file."""
    out: list[Run] = []
    for row, index in enumerate(indices):
        file, local = dataset.locate(int(index))
        last = out[-1] if out else None
        if last is not None and last.file == file and last.start + last.n == local:
            out[-1] = last._replace(n=last.n + 1)
        else:
            out.append(Run(file, local, 1, row))
    return out


def crop(dataset: Any) -> tuple[slice, slice]:
    """Rows and columns a sample is read from: the dataset's tile when it has one, else
    the first `img_size` rows and columns."""
    tile = getattr(dataset, "tile", None)
    if tile is not None:
        return tile.rows, tile.cols
    H, W = dataset.img_size
    return slice(0, H), slice(0, W)


def read_run(fields: Any, run: Run, dt: int, rows: slice, cols: slice
             ) -> tuple[np.ndarray, np.ndarray]:
    """Raw input rows and target rows of one run, read with one hyperslab (two if n < dt)."""
    t, n = run.start, run.n
    if n >= dt:  # input and target rows overlap or touch
        block = fields[t:t + n + dt, :, rows, cols]
        return block[:n], block[dt:dt + n]
    return fields[t:t + n, :, rows, cols], fields[t + dt:t + dt + n, :, rows, cols]


def read_batch(dataset: Any, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised (input, target) batches of `indices`, each (B, C, rows, cols) float32."""
    rows, cols = crop(dataset)
    shape = (len(indices), dataset.n_channels, rows.stop - rows.start, cols.stop - cols.start)
    inp = np.empty(shape, dtype=np.float32)
    tar = np.empty_like(inp)
    for run in runs(dataset, indices):
        source = mapped(dataset.files[run.file])
        if source is not None:  # zero-copy: normalise straight from the mapped file
            for j in range(run.n):
                t = run.start + j
                np.subtract(source.sample(t)[:, rows, cols], dataset.means, out=inp[run.row + j])
                np.subtract(source.sample(t + dataset.dt)[:, rows, cols], dataset.means,
                            out=tar[run.row + j])
            continue
        raw_inp, raw_tar = read_run(dataset._fields(run.file), run, dataset.dt, rows, cols)
        batch_rows = slice(run.row, run.row + run.n)
        np.subtract(raw_inp, dataset.means, out=inp[batch_rows])
        np.subtract(raw_tar, dataset.means, out=tar[batch_rows])
    np.divide(inp, dataset.stds, out=inp)
    np.divide(tar, dataset.stds, out=tar)
    return torch.from_numpy(inp), torch.from_numpy(tar)


def keep_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The DataLoader's collate function: `__getitems__` already made the batch."""
    return batch
