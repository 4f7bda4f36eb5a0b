"""The training loss, written once for every layout.

The tutorial's loss is the relative L2 error: mean over the batch of ||pred_b - target_b|| /
||target_b||, the norms over all channels and pixels of the grid. It is computed in fp32
even under autocast: each norm sums ~10^5 squares.

A layout whose ranks hold tiles of the grid (spatial parallelism) passes `sum_over_grid`:
each rank's norms are then of its tile only, and the squares are summed over the mesh before
the root (distributed/layout.py decides which reduction).

Its gradient is written out (`RelativeL2`) rather than left to autograd, which would take a
pass over the whole field for every small op of the norm's backward (a division, a mask, a
multiplication, a cast back to the prediction's dtype):
    d loss / d pred_b = diff_b / (B ||diff_b|| ||target_b||)      (0 where diff_b = 0)
one pass, written in the prediction's dtype. The forward subtracts in fp32 straight from the
prediction's dtype (no separate cast). The norms are over the whole grid, so on a mesh the
gradient of each rank's tile uses the summed norms and needs no communication.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

SumOverGrid = Callable[[torch.Tensor], torch.Tensor]


class RelativeL2(torch.autograd.Function):
    """mean_b ||pred_b - target_b|| / ||target_b||, with its gradient for `pred` (the
    target is data: no gradient)."""

    @staticmethod
    def forward(ctx: Any, pred: torch.Tensor, target: torch.Tensor,
                sum_over_grid: SumOverGrid | None) -> torch.Tensor:
        b = pred.shape[0]
        target = target.to(torch.promote_types(target.dtype, torch.float32)).reshape(b, -1)
        diff = torch.sub(pred.reshape(b, -1), target)  # at least fp32, from any pred: one pass
        norms = torch.stack([torch.linalg.vector_norm(diff, dim=1),
                             torch.linalg.vector_norm(target, dim=1)])
        if sum_over_grid is not None:  # norms of this rank's tile: complete them over the grid
            norms = sum_over_grid(norms.square()).sqrt()
        ctx.save_for_backward(diff, norms)
        ctx.pred_shape, ctx.pred_dtype = pred.shape, pred.dtype
        return (norms[0] / norms[1]).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        diff, (d, t) = ctx.saved_tensors
        scale = (grad / (diff.shape[0] * d * t)).masked_fill(d == 0, 0.0)
        out = torch.empty(diff.shape, dtype=ctx.pred_dtype, device=diff.device)
        torch.mul(diff, scale[:, None], out=out)
        return out.reshape(ctx.pred_shape), None, None


def l2_loss(pred: torch.Tensor, target: torch.Tensor,
            sum_over_grid: SumOverGrid | None = None) -> torch.Tensor:
    """Relative L2 error of (B, ...) fields, averaged over the batch."""
    if target.requires_grad:
        raise ValueError("l2_loss differentiates the prediction only; its target is data")
    return RelativeL2.apply(pred, target, sum_over_grid)
