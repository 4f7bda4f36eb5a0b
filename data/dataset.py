"""The ERA5 layout as a dataset: (input at t, target at t + dt) pairs; for training on
rollouts (`rollout_steps` K > 1) the targets at t + dt, ..., t + K*dt. Shared by the
PyTorch loader (data/loader.py) and the DALI loader (data/dali.py).

<data_dir>/{train,valid,test}/<year>.h5 each hold a dataset "fields" of shape
(n_samples, channels, H, W); samples are 6 hours apart. Every file records its grid
(`latitude`, `longitude`; data/grid.py), which must agree with the grid beside the
statistics and be the same in every file. Fields are normalised with the global
per-channel means and standard deviations; an `img_size` smaller than the grid reads its
first rows and columns, a crop stated once in the log. With a `tile`
(spatial parallelism) a rank reads only its block of rows and columns of that grid: an HDF5
hyperslab read, so its memory and read volume shrink with the mesh.
"""

from __future__ import annotations

import glob
import itertools
import os
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from data.batch_read import read_batch
from data.checks import FieldsReader, check_dtypes
from data.grid import Grid, agree, crop_to, read_file_grid
from data.statistics import load_stats, load_stds, stats_grid
from utils.config_schema import Config
from utils.errors import DataError
from utils.tile import Tile


def list_year_files(path: str) -> list[str]:
    if not os.path.isdir(path):
        raise DataError(f"data directory {path} does not exist "
                        "(make the synthetic data with `python -m data.synthetic`, "
                        "or set DATA_DIR)")
    files = sorted(glob.glob(os.path.join(path, "*.h5")))
    if not files:
        raise DataError(f"no .h5 files in {path}")
    return files


class ERA5Dataset(Dataset):
    """Sample i -> (normalised fields at t, normalised fields at t + dt), each (C, H, W), or
    (C, rows, cols) of `tile` (a block of the `img_size` grid). A training set with
    `rollout_steps` K > 1 gives the K targets at t + dt, ..., t + K*dt stacked as
    (K, C, H, W); validation stays one step."""

    def __init__(self, cfg: Config, location: str, train: bool, tile: Tile | None = None):
        self.location = location
        self.files = list_year_files(location)
        self.train = train
        self.dt = cfg.dt
        self.steps = cfg.rollout_steps if train else 1
        self.n_channels = cfg.n_in_channels
        self.img_size = tuple(cfg.img_size)
        self.tile = tile or Tile.whole(self.img_size)
        if self.tile.grid != self.img_size:
            raise ValueError(f"tile of a {self.tile.grid} grid, img_size is {self.img_size}")
        # stats/ is read whole first (the normalisation, then the grid every year file must
        # agree with), the year files after it.
        means = load_stats(cfg.global_means_path, self.n_channels, "global means")
        stds = load_stds(cfg.global_stds_path, self.n_channels)
        if means.shape[2:] != (1, 1) or stds.shape[2:] != (1, 1):
            raise DataError(f"global means/stds must be (1, {self.n_channels}, 1, 1), got "
                            f"{means.shape} and {stds.shape}")
        self.means, self.stds = means[0], stds[0]  # (C, 1, 1)
        self.stats_grid = stats_grid(cfg)
        self.samples_per_file = []
        grids: list[Grid] = []
        for path in self.files:
            self.samples_per_file.append(self._check_file(path, grids))
        self.grid = crop_to(grids[0], self.img_size, location)
        check_dtypes(self.files)
        self.offsets = np.cumsum([0] + self.samples_per_file)
        self.n_samples = int(self.offsets[-1])
        limit = cfg.limit_nsamples if train else cfg.limit_nsamples_val
        if limit is not None:
            self.n_samples = min(self.n_samples, int(limit))
        if self.n_samples <= 0:
            raise DataError(f"{location} has no (t, t+{self.dt * self.steps}) sample pairs")
        self._handles: list[FieldsReader | None] = [None] * len(self.files)
        self._pid = None

    def _check_file(self, path: str, grids: list[Grid]) -> int:
        """Samples of one year file that start a pair; its grid is appended to `grids`."""
        try:
            with h5py.File(path, "r") as f:
                if "fields" not in f:
                    raise DataError(f"{path} has no dataset 'fields' (found: {list(f.keys())})")
                shape = f["fields"].shape
                if len(shape) != 4:
                    raise DataError(f"{path}: 'fields' has shape {shape}, expected "
                                    "(n, C, H, W)")
                grid = read_file_grid(f, path, shape[2:])
        except OSError as e:
            raise DataError(f"{path} is not a readable HDF5 file: {e}") from None
        if grids and not grid.same_as(grids[0]):
            raise DataError(f"{self.location} mixes grids: {path} is {grid.describe()}, "
                            f"{self.files[0]} is {grids[0].describe()}")
        if not agree(grid, self.stats_grid):
            raise DataError(f"{path}: its grid ({grid.describe()}) is not the one beside "
                            f"the statistics ({self.stats_grid.describe()}); prepare the "
                            "data and its stats/ together")
        grids.append(grid)
        n, c, h, w = shape
        if c != self.n_channels:
            raise DataError(f"{path}: 'fields' has {c} channels, config n_in_channels is "
                            f"{self.n_channels}")
        if h < self.img_size[0] or w < self.img_size[1]:
            raise DataError(f"{path}: fields are {h}x{w}, smaller than img_size "
                            f"{self.img_size[0]}x{self.img_size[1]}")
        return max(n - self.dt * self.steps, 0)  # the last target stays inside the file

    def __len__(self) -> int:
        return self.n_samples

    def locate(self, index: int) -> tuple[int, int]:
        """Global sample index -> (file index, index within the file)."""
        if not 0 <= index < self.n_samples:
            raise IndexError(f"sample {index} outside [0, {self.n_samples})")
        file_idx = int(np.searchsorted(self.offsets, index, side="right") - 1)
        return file_idx, index - int(self.offsets[file_idx])

    def _fields(self, file_idx: int):
        # HDF5 handles must not cross fork(): open lazily, once per worker process.
        if self._pid != os.getpid():
            self._handles, self._pid = [None] * len(self.files), os.getpid()
        if self._handles[file_idx] is None:
            # Keep the dataset object, not just the file: looking "fields" up per sample
            # rebuilds h5py's per-dataset state for every sample read.
            path = self.files[file_idx]
            self._handles[file_idx] = FieldsReader(h5py.File(path, "r")["fields"], path)
        return self._handles[file_idx]

    def read_pair(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Raw (un-normalised) input and target arrays of the tile (default: the `img_size`
        crop). Slicing the h5py dataset reads only that hyperslab from the file."""
        file_idx, local = self.locate(index)
        rows, cols = self.tile.rows, self.tile.cols
        fields = self._fields(file_idx)
        inp = fields[local, :, rows, cols]
        if self.steps == 1:
            tar = fields[local + self.dt, :, rows, cols]
        else:  # one strided hyperslab read: (K, C, rows, cols)
            last = local + self.dt * self.steps
            tar = fields[local + self.dt:last + 1:self.dt, :, rows, cols]
        return inp, tar

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inp, tar = self.read_pair(index)
        for x in (inp, tar):  # fresh arrays from h5py: normalise in place, no temporaries
            x -= self.means
            x /= self.stds
        return torch.from_numpy(inp), torch.from_numpy(tar)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole batch (the DataLoader calls this instead of `__getitem__` per sample):
        fewer HDF5 reads and one normalisation pass, see data/batch_read.py. K-step
        targets (`rollout_steps` > 1) are read sample by sample."""
        if self.steps > 1:
            pairs = [self[i] for i in indices]
            return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        return read_batch(self, indices)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handles"], state["_pid"] = [None] * len(self.files), None
        return state


class ShardSampler(DistributedSampler):
    """`DistributedSampler` that can start an epoch part-way, to resume mid-epoch.

    The order depends only on (seed, epoch): a resumed run skips the batches already done
    and then sees exactly the samples the uninterrupted run would have seen.
    """

    def __init__(self, dataset: Dataset, batch_size: int, **kwargs: Any):
        super().__init__(dataset, **kwargs)
        self.batch_size = batch_size
        self.skip = 0
        if not self.drop_last:
            # Validation: no padding by repeated samples (they would be counted twice);
            # rank r takes samples r, r + R, ... and shards may differ in length by one.
            self.total_size = len(dataset)
            self.num_samples = len(range(self.rank, self.total_size, self.num_replicas))

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip = skip_batches * self.batch_size

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return max(super().__len__() - self.skip, 0)


def dataset_and_sampler(cfg: Config, location: str, train: bool, num_replicas: int = 1,
                        rank: int = 0, tile: Tile | None = None, *, batch_size: int
                        ) -> tuple[ERA5Dataset, ShardSampler]:
    """The dataset and its seeded shard sampler, shared by the PyTorch and DALI loaders."""
    dataset = ERA5Dataset(cfg, location, train, tile)
    sampler = ShardSampler(dataset, batch_size, num_replicas=num_replicas, rank=rank,
                           shuffle=train, seed=cfg.seed, drop_last=train)
    return dataset, sampler
