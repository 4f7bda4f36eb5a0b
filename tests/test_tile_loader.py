"""Loaders for spatial parallelism: each rank of the h x w mesh reads only its tile of every
field (an HDF5 hyperslab), and the tiles are exactly the crops of the whole-field read.

Tiny data from conftest (16 x 32 grid): tiles from a 2 x 2 mesh, an uneven 3 x 1 split of
the rows, and a single row. The ranks of one data-parallel replica read the same samples
in the same order: put back together, their batches are the whole-field loader's batch.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from data.loader import ERA5Dataset, get_data_loader, get_loader
from utils.tile import Tile

GRID = (16, 32)
MESH_2X2 = [Tile(GRID, rows, cols) for rows in (slice(0, 8), slice(8, 16))
            for cols in (slice(0, 16), slice(16, 32))]
TILES = [*MESH_2X2, Tile(GRID, slice(0, 8), slice(0, 32)),     # h 3: 8 + 4 + 4 rows (patch 4)
         Tile(GRID, slice(12, 16), slice(0, 32)), Tile(GRID, slice(5, 6), slice(3, 29))]


@pytest.mark.parametrize("train", [True, False], ids=["train", "valid"])
def test_a_tile_read_is_exactly_the_crop_of_the_whole_field_read(tiny_params, train):
    path = tiny_params.train_data_path if train else tiny_params.valid_data_path
    whole = ERA5Dataset(tiny_params, path, train)
    for tile in TILES:
        part = ERA5Dataset(tiny_params, path, train, tile)
        for i in (0, 7, len(whole) - 1):  # first file, and the last sample of the split
            (inp, tar), (full_inp, full_tar) = part[i], whole[i]
            assert inp.shape == tar.shape == (20, *tile.shape)
            assert torch.equal(inp, full_inp[:, tile.rows, tile.cols]), (tile, i)
            assert torch.equal(tar, full_tar[:, tile.rows, tile.cols]), (tile, i)


def test_a_tile_read_allocates_only_the_tile(tiny_params):
    """The arrays h5py returns are the tile's size: the file is read as a hyperslab, not as
    the whole field cropped afterwards (numpy reports its allocations to tracemalloc)."""
    path = tiny_params.train_data_path
    whole = ERA5Dataset(tiny_params, path, True)
    quarter = ERA5Dataset(tiny_params, path, True, MESH_2X2[3])
    field_bytes = 20 * GRID[0] * GRID[1] * 4

    def peak(dataset: ERA5Dataset) -> int:
        dataset.read_pair(1)  # open the file first: h5py's own set-up is not the read
        tracemalloc.start()
        inp, tar = dataset.read_pair(2)
        size = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert isinstance(inp, np.ndarray) and inp.nbytes + tar.nbytes <= size
        return size

    assert peak(whole) >= 2 * field_bytes
    assert peak(quarter) < 2 * field_bytes / 4 + 16_384  # two tiles, plus small objects


def _stitch(tiles: list[torch.Tensor]) -> torch.Tensor:
    """The 2 x 2 mesh's batches (in MESH_2X2 order) -> the whole-field batch."""
    top = torch.cat(tiles[:2], dim=-1)
    bottom = torch.cat(tiles[2:], dim=-1)
    return torch.cat([top, bottom], dim=-2)


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_the_ranks_of_a_mesh_read_the_same_samples_sharded_over_dp_only(tiny_params, dp_rank):
    tiny_params = tiny_params.replace(local_batch_size=2)
    shard = {"num_replicas": 2, "rank": dp_rank}
    ref, _, ref_sampler = get_data_loader(tiny_params, tiny_params.train_data_path, True,
                                          **shard, batch_size=tiny_params.local_batch_size)
    loaders = [get_loader(tiny_params, tiny_params.train_data_path, True, tile=t, **shard,
                          batch_size=tiny_params.local_batch_size)
               for t in MESH_2X2]
    for epoch in (0, 3):
        ref_sampler.set_epoch(epoch)
        for _, _, sampler in loaders:
            sampler.set_epoch(epoch, skip_batches=1)  # a resumed epoch: same skip on each
        ref_batches = list(ref)[1:]
        mesh_batches = zip(*(loader for loader, _, _ in loaders), strict=True)
        for (inp, tar), tiles in zip(ref_batches, mesh_batches, strict=True):
            assert torch.equal(_stitch([t[0] for t in tiles]), inp)
            assert torch.equal(_stitch([t[1] for t in tiles]), tar)


def test_dali_reads_the_same_tiles_as_the_pytorch_loader(tiny_params):
    pytest.importorskip("nvidia.dali")
    from data.dali import get_data_loader_dali

    tiny_params = tiny_params.replace(num_data_workers=0)
    tile = TILES[-1]  # uneven, off the edges
    ref, _, ref_sampler = get_data_loader(tiny_params, tiny_params.valid_data_path, False,
                                          tile=tile, batch_size=tiny_params.local_batch_size)
    loader, _, sampler = get_data_loader_dali(tiny_params, tiny_params.valid_data_path, False,
                                              tile=tile, batch_size=tiny_params.local_batch_size)
    try:
        n = 0
        for (inp, tar), (ref_inp, ref_tar) in zip(loader, ref, strict=True):
            assert inp.shape == ref_inp.shape and inp.shape[-2:] == tile.shape
            torch.testing.assert_close(inp, ref_inp, rtol=0, atol=1e-6)
            torch.testing.assert_close(tar, ref_tar, rtol=0, atol=1e-6)
            n += inp.shape[0]
        assert n == len(sampler)  # validation keeps every sample, the padded batch cut
    finally:
        loader.close()


def test_a_tile_outside_the_grid_is_refused():
    with pytest.raises(ValueError, match="not a non-empty block of"):
        Tile(GRID, slice(8, 17), slice(0, 32))
    with pytest.raises(ValueError, match="not a non-empty block of"):
        Tile(GRID, slice(4, 4), slice(0, 32))
    assert Tile.whole(GRID).is_whole and not MESH_2X2[0].is_whole
