"""The training loss, written once for every layout.

The tutorial's loss is the relative L2 error: mean over the batch of ||pred_b - target_b|| /
||target_b||, the norms over all channels and pixels of the grid. It is computed in fp32
even under autocast: each norm sums ~10^5 squares.

A layout whose ranks hold tiles of the grid (spatial parallelism) passes `sum_over_grid`:
each rank's norms are then of its tile only, and the squares are summed over the mesh before
the root (distributed/layout.py decides which reduction; its backward is the identity,
since every rank goes on to compute the same loss from the summed squares).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def l2_loss(pred: torch.Tensor, target: torch.Tensor,
            sum_over_grid: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Relative L2 error of (B, ...) fields, averaged over the batch."""
    b = pred.shape[0]
    diff = (pred.float() - target.float()).reshape(b, -1)
    norms = torch.stack([diff.norm(dim=1), target.float().reshape(b, -1).norm(dim=1)])
    if sum_over_grid is not None:  # norms of this rank's tile: complete them over the grid
        norms = sum_over_grid(norms.square()).sqrt()
    return (norms[0] / norms[1]).mean()
