"""The training and validation loaders: PyTorch's DataLoader over the ERA5 dataset
(data/dataset.py), optionally run ahead by a prefetch thread, or NVIDIA DALI's
(data/dali.py); `get_loader` picks the one the config names."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from data.batch_read import keep_batch
from data.dataset import ERA5Dataset, ShardSampler, dataset_and_sampler
from data.prefetch import PrefetchLoader
from utils.config_schema import Config
from utils.tile import Tile


def get_loader(cfg: Config, location: str, train: bool, num_replicas: int = 1, rank: int = 0,
               tile: Tile | None = None, *, batch_size: int
               ) -> tuple[Any, ERA5Dataset, ShardSampler]:
    """The loader `cfg.data_loader_config` names ('pytorch' or 'dali'), of `batch_size`
    samples per batch: returns (loader, dataset, sampler). Data-parallel ranks pass their dp
    rank and size; spatially parallel ranks their `tile` (the ranks of one mesh read the
    same samples)."""
    if cfg.data_loader_config == "dali":
        from data.dali import get_data_loader_dali  # optional dependency: import on use

        return get_data_loader_dali(cfg, location, train, num_replicas, rank, tile,
                                    batch_size=batch_size)
    loader, dataset, sampler = get_data_loader(cfg, location, train, num_replicas, rank, tile,
                                               batch_size=batch_size)
    if cfg.prefetch_thread:  # the loader runs ahead in a thread (data/prefetch.py)
        return PrefetchLoader(loader), dataset, sampler
    return loader, dataset, sampler


def get_data_loader(cfg: Config, location: str, train: bool, num_replicas: int = 1,
                    rank: int = 0, tile: Tile | None = None, *, batch_size: int
                    ) -> tuple[DataLoader, ERA5Dataset, ShardSampler]:
    """The PyTorch DataLoader: returns (loader, dataset, sampler).

    The sampler is always a seeded `ShardSampler` (one replica when not distributed)
    so that the sample order depends only on (seed, epoch) and data-parallel ranks read
    disjoint shards. Model-parallel ranks pass their data-parallel rank and size.
    """
    dataset, sampler = dataset_and_sampler(cfg, location, train, num_replicas, rank, tile,
                                           batch_size=batch_size)
    workers = cfg.num_data_workers
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=torch.cuda.is_available(),
        drop_last=train,
        collate_fn=keep_batch,  # __getitems__ returns the batch ready
    )
    return loader, dataset, sampler
