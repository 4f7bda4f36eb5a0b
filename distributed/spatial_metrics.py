"""Loss and skill scores of fields split into tiles over the h x w mesh.

Each rank holds a tile (B, C, rows, cols) of the global (B, C, H, W) field. Every score is
a ratio of sums over the global grid: each rank sums over its tile, one all-reduce over
"h-w" completes the sums, and every rank then holds the serial model's value. The
latitude weights of a tile are the global ones (utils.evaluation) at the tile's rows.
"""

from __future__ import annotations

import torch

from distributed.helpers import all_reduce
from distributed.mappings import reduce_from_parallel_region
from utils.evaluation import latitude_weights

GROUP = "h-w"


def l2_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """utils.evaluation.l2_loss of the global fields from their tiles: mean over the batch of
    ||pred_b - target_b|| / ||target_b||, norms over all channels and pixels of the grid.

    Differentiable: the all-reduce's backward is the identity, since every rank goes on
    to compute the same loss from the summed squares (as in tensor parallelism)."""
    b = pred.shape[0]
    diff = (pred.float() - target.float()).reshape(b, -1)
    sums = torch.stack([diff.square().sum(1), target.float().reshape(b, -1).square().sum(1)])
    sums = reduce_from_parallel_region(sums, GROUP)
    return (sums[0].sqrt() / sums[1].sqrt()).mean()


def tile_latitude_weights(num_lat: int, rows: slice,
                          device: torch.device | str = "cpu") -> torch.Tensor:
    """(rows, 1) latitude weights of a tile: those of the global grid of `num_lat` rows
    at the tile's rows (`distributed.spatial.tile_bounds(...)[0]`)."""
    return latitude_weights(num_lat, device)[rows]


@torch.no_grad()
def weighted_rmse_channels(pred: torch.Tensor, target: torch.Tensor, num_lat: int,
                           rows: slice, num_pixels: int) -> torch.Tensor:
    """(B, C) latitude-weighted RMSE of the global fields (utils.evaluation's), from tiles.
    `num_pixels` = H x W of the global grid."""
    w = tile_latitude_weights(num_lat, rows, pred.device)
    sq = torch.sum(w * (pred.float() - target.float()) ** 2, dim=(-1, -2))
    return torch.sqrt(all_reduce(sq, GROUP) / num_pixels)


@torch.no_grad()
def weighted_acc_channels(pred: torch.Tensor, target: torch.Tensor,
                          climatology: torch.Tensor, num_lat: int,
                          rows: slice) -> torch.Tensor:
    """(B, C) latitude-weighted anomaly correlation of the global fields, from tiles (the
    climatology tile matches the fields' tile)."""
    w = tile_latitude_weights(num_lat, rows, pred.device)
    a_p, a_t = pred.float() - climatology, target.float() - climatology
    sums = torch.stack([torch.sum(w * a_p * a_t, dim=(-1, -2)),
                        torch.sum(w * a_p**2, dim=(-1, -2)),
                        torch.sum(w * a_t**2, dim=(-1, -2))])
    num, pp, tt = all_reduce(sums, GROUP)
    return num / torch.sqrt(pp * tt)
