"""The training loss of fields split into tiles over the h x w mesh.

Each rank holds a tile (B, C, rows, cols) of the global (B, C, H, W) field. The loss is a
ratio of sums over the global grid: each rank sums over its tile, one all-reduce over
"h-w" completes the sums, and every rank then holds the serial model's value. The skill
scores (RMSE, ACC) of tiles are utils.evaluation's, given the rank's `Tile`: they need no
gradient, so they reduce with a plain all-reduce.
"""

from __future__ import annotations

import torch

from distributed.mappings import reduce_from_parallel_region

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
