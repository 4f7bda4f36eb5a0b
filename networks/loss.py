"""The training loss, chosen here and nowhere else: the config's `loss` key names one of
`LOSSES`, `build_loss` builds it, and training (one step or a rollout), validation and the
benchmarks all call that one object. To change the loss, change this file (a new choice
also gets its name in the schema's `loss` key, utils/config_schema.py).

  relative_l2   the tutorial's: mean over the batch of ||pred_b - target_b|| / ||target_b||,
                the norms over all channels and pixels of the grid.
  weighted_mse  the mean over samples, channels and grid points of w(row) (pred - target)^2,
                w the rows' cell areas on the sphere, mean 1 (evaluation/regions.py): the
                latitude-weighted MSE that WeatherBench-2 scores (GraphCast and ClimaX train
                on forms of it). A lat-lon grid has as many points on a polar row as on the
                equator: weighted, each point counts for the area it covers.

Both are computed in fp32 even under autocast: their sums run over ~10^5 terms per sample.

A layout whose ranks hold tiles of the grid (spatial parallelism) passes `sum_over_grid`:
each rank's sums are then of its tile only and are completed over the mesh (the layout says
how: `distributed.layout.Layout.sum_over_grid`); every rank gets the loss of the whole grid,
and the gradient of its own tile.

The relative L2's gradient is written out (`RelativeL2`) rather than left to autograd, which
would take a pass over the whole field for every small op of the norm's backward (a
division, a mask, a multiplication, a cast back to the prediction's dtype):
    d loss / d pred_b = diff_b / (B ||diff_b|| ||target_b||)      (0 where diff_b = 0)
one pass, written in the prediction's dtype. The forward subtracts in fp32 straight from the
prediction's dtype (no separate cast). The norms are over the whole grid, so on a mesh the
gradient of each rank's tile uses the summed norms and needs no communication.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

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


class RelativeL2Loss(nn.Module):
    """`l2_loss` as the module training calls (its sums completed by `sum_over_grid`)."""

    def __init__(self, sum_over_grid: SumOverGrid | None = None):
        super().__init__()
        self.sum_over_grid = sum_over_grid

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return l2_loss(pred, target, self.sum_over_grid)


class LatitudeWeightedMSE(nn.Module):
    """mean over (B, C, rows, columns) of row_weights[row] (pred - target)^2; `row_weights`
    (rows,) are those of the fields' rows (a tile's rows on a mesh), mean 1 over the whole
    grid's rows."""

    def __init__(self, row_weights: torch.Tensor, sum_over_grid: SumOverGrid | None = None):
        super().__init__()
        self.register_buffer("row_weights", row_weights.float(), persistent=False)
        self.sum_over_grid = sum_over_grid

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        squares = (pred.float() - target.float()).square()
        by_row = squares.sum(dim=-1)  # the weights vary by row only: columns first
        sums = torch.stack([(by_row * self.row_weights).sum(),
                            squares.new_tensor(float(squares.numel()))])
        if self.sum_over_grid is not None:  # this tile's sums: complete them over the mesh
            sums = self.sum_over_grid(sums)
        return sums[0] / sums[1]


# The config's `loss` -> the loss of fields with these rows' weights, on a grid whose sums
# `sum_over_grid` completes (None: the fields are the whole grid).
LOSSES: dict[str, Callable[[torch.Tensor, SumOverGrid | None], nn.Module]] = {
    "relative_l2": lambda row_weights, sum_over_grid: RelativeL2Loss(sum_over_grid),
    "weighted_mse": LatitudeWeightedMSE,
}


def build_loss(name: str, row_weights: torch.Tensor,
               sum_over_grid: SumOverGrid | None = None) -> nn.Module:
    """The loss `name` (the config's `loss`) of (B, C, rows, columns) fields whose rows have
    `row_weights` (the whole grid's latitude weights, or a tile's rows of them)."""
    return LOSSES[name](row_weights, sum_over_grid)
