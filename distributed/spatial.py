"""Spatial parallelism for the AFNO model: the (h, w) token grid split into tiles over the
"h" (rows, latitude) and "w" (columns, longitude) process groups, uneven splits allowed.

Rank (i, j) holds token rows chunk i and columns chunk j (`compute_split_shapes`), and the
pixels under them: patches do not overlap, so the patch embedding, the LayerNorms, the
channel MLPs and the head run on the tile as they are. The position embedding is sharded:
each rank holds its tile's slice. Only the spectral filter talks to other ranks, through
the distributed FFT (distributed.fft).

Every other parameter is replicated on the mesh and sees only its tile's tokens, so its
gradient there is a partial sum: annotated `partial_grad_mp = [h, w]`, it is completed by
`distributed.helpers.sync_shared_gradients` (the sum the serial model computes).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distributed import comm
from distributed.fft import Modes, RealFFT2, balanced_split
from distributed.helpers import (
    annotate,
    compute_split_shapes,
    shard_tensor,
)
from utils.parallel_axes import family_axes
from utils.tile import Tile

SPATIAL_GROUPS = family_axes("spatial")  # the axes of the tile's rows, then of its columns


def tile_bounds(grid: tuple[int, int], patch_size: int = 1) -> tuple[slice, slice]:
    """(rows, columns) of this rank's tile, in pixels (`patch_size` per token) of the
    global field; with patch_size 1, in tokens. rows.start is the global row offset that
    selects this tile's latitudes."""
    bounds = []
    for axis, n in zip(SPATIAL_GROUPS, grid, strict=True):
        sizes = compute_split_shapes(n, comm.get_size(axis))
        start = sum(sizes[: comm.get_rank(axis)])
        bounds.append(slice(start * patch_size, (start + sizes[comm.get_rank(axis)]) * patch_size))
    return bounds[0], bounds[1]


def field_tile(img_size: tuple[int, int] | list[int], patch_size: int) -> Tile:
    """This rank's `Tile` of the (H, W) field: the pixels under its tokens. The loaders read
    only it, and the skill scores (evaluation.scores) sum over it and then over the mesh."""
    H, W = (int(n) for n in img_size)
    rows, cols = tile_bounds((H // patch_size, W // patch_size), patch_size)
    return Tile((H, W), rows, cols)


class SpatialLayers:
    """Drop-in for `networks.afno.SerialGrid`: tiles of the token grid on the h x w mesh."""

    def tile(self, grid: tuple[int, int]) -> tuple[int, int]:
        rows, cols = tile_bounds(grid)
        return rows.stop - rows.start, cols.stop - cols.start

    def spectral_transform(self, modes: Modes, num_blocks: int, block_size: int) -> RealFFT2:
        """The distributed FFT keeping `modes`; the spectrum's channels split over w in
        whole blocks (the spectral MLP is block-diagonal, so each rank applies its blocks'
        weights)."""
        blocks = balanced_split(num_blocks, comm.get_size("w"))
        return RealFFT2(modes, num_blocks * block_size,
                        [n * block_size for n in blocks], groups=SPATIAL_GROUPS)

    def annotate(self, model: nn.Module) -> None:
        """pos_embed (1, h, w, D) is sharded over h and w; every other parameter is
        replicated, with a partial gradient over h and w (its tile's tokens only)."""
        for p in model.parameters():
            if p is model.pos_embed:
                annotate(p, sharded_dims=[None, "h", "w", None])
                p.full_shape = (1, *model.grid, p.shape[-1])  # the split may be uneven
            else:
                annotate(p, partial_grad=SPATIAL_GROUPS)

    # Initialisation draws every parameter's full serial tensor and keeps this rank's part.
    def full_shape(self, param: torch.Tensor) -> list[int]:
        return list(getattr(param, "full_shape", param.shape))

    def local_part(self, full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        return shard_tensor(full, param)
