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
  crps          the almost-fair ensemble CRPS of an ensemble forecast, latitude-weighted as
                weighted_mse (below: "The ensemble CRPS").

All are computed in fp32 even under autocast: their sums run over ~10^5 terms per sample.

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

The ensemble CRPS. An ensemble forecast holds E members per sample: predictions are
(B, E, C, H, W), members on dim 1, and the target (B, C, H, W) has no member axis. At each
grid point, for members x_1..x_E and truth y,
    CRPS_alpha = (1/E) sum_i |x_i - y|  -  (w / 2) sum_{i,j} |x_i - x_j|,
    w = alpha / (E (E - 1)) + (1 - alpha) / E^2
alpha = 1 is the fair (unbiased) estimator of the CRPS of the distribution the members are
drawn from, alpha = 0 the CRPS of the members' empirical distribution, which rewards too
little spread. With alpha = 1 and E = 2 the score is 0 wherever the truth lies between the
two members, whatever their distance: training uses alpha slightly below 1 (the config's
`crps_alpha`, 0.95 as in AIFS-CRPS) and validation and evaluation the fair score. The loss
module picks alpha from its mode, as dropout does: `crps_alpha` in training mode, 1 after
`.eval()`. The pairwise sum is computed from the sorted members (`member_spread_sum`:
O(E log E), no E x E tensor). `almost_fair_crps` is a pure function of the whole member set:
where the members are split over ranks (ensemble parallelism), the layout passes
`gather_members`, which gathers every rank's members of each sample before the score (the
layout says how: `distributed.layout.Layout.gather_members`); every rank then computes the
same loss, and the backward gives each rank the gradient of its own members.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from utils.config_schema import Config
from utils.errors import ConfigError

SumOverGrid = Callable[[torch.Tensor], torch.Tensor]
GatherMembers = Callable[[torch.Tensor], torch.Tensor]  # (B, M, ...) -> (B, E, ...)


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


def weighted_grid_mean(values: torch.Tensor, row_weights: torch.Tensor,
                       sum_over_grid: SumOverGrid | None = None) -> torch.Tensor:
    """mean over (..., rows, columns) of row_weights[row] * values, completed over the grid
    by `sum_over_grid` when `values` are a tile of it (`row_weights`: the tile's rows)."""
    by_row = values.sum(dim=-1)  # the weights vary by row only: columns first
    sums = torch.stack([(by_row * row_weights).sum(), values.new_tensor(float(values.numel()))])
    if sum_over_grid is not None:  # this tile's sums: complete them over the mesh
        sums = sum_over_grid(sums)
    return sums[0] / sums[1]


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
        return weighted_grid_mean(squares, self.row_weights, self.sum_over_grid)


def member_spread_sum(members: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """sum over i, j of |x_i - x_j| (every pair twice) for the members x along `dim`; that
    dim is reduced. With the members sorted, x_(1) <= ... <= x_(E), the sum is
    2 sum_k c_k x_(k), c_k = (members below x_(k)) - (members above it): 2k - E - 1 where
    x_(k) ties with none. Counting (not the sort's positions) gives tied members one
    coefficient, the mean of their positions', so the gradient at a tie is that of the
    pairwise sum with sign(0) = 0: the same for every member of the tie, whatever order
    the sort left them in. An untrained ensemble's members all tie (networks/noise.py)."""
    x = torch.sort(members.movedim(dim, -1), dim=-1).values
    E = x.shape[-1]
    s = x.detach().contiguous()  # searchsorted reads rows of contiguous memory
    below = torch.searchsorted(s, s, side="left", out_int32=True)
    above = E - torch.searchsorted(s, s, side="right", out_int32=True)
    return 2.0 * (x * (below - above).to(x.dtype)).sum(dim=-1)


def spread_weight(ensemble_size: int, alpha: float) -> float:
    """w of CRPS_alpha (module docstring): the weight of the pairwise sum. E = 1 has no
    pairs: only alpha = 0 (the score is then the absolute error) is defined."""
    E = ensemble_size
    if E < 2 and alpha > 0:
        raise ConfigError(f"the ensemble CRPS with alpha {alpha} needs at least 2 members per "
                          f"sample, got {E}")
    fair = alpha / (E * (E - 1)) if alpha > 0 else 0.0
    return fair + (1.0 - alpha) / E**2


def almost_fair_crps(members: torch.Tensor, truth: torch.Tensor, alpha: float = 1.0,
                     dim: int = 1) -> torch.Tensor:
    """CRPS_alpha at every point (module docstring) of the ensemble `members`, its members
    along `dim`, against `truth` (the members' shape without that dim); computed in fp32
    outside autocast, whatever the inputs' dtype. Returns the members' shape without `dim`."""
    with torch.autocast(members.device.type, enabled=False):
        members, truth = members.float(), truth.float()
        skill = (members - truth.unsqueeze(dim)).abs().mean(dim=dim)
        w = spread_weight(members.shape[dim], alpha)
        if members.shape[dim] == 1:  # no pairs (alpha = 0): the absolute error
            return skill
        return skill - 0.5 * w * member_spread_sum(members, dim)


class EnsembleCRPS(nn.Module):
    """mean over (B, C, rows, columns) of row_weights[row] CRPS_alpha(pred, target), pred
    (B, E, C, rows, columns) with E >= 2 members, target (B, C, rows, columns); alpha is
    `alpha` in training mode and 1 (the fair score) in eval mode. `row_weights` and
    `sum_over_grid` as in `LatitudeWeightedMSE`; `gather_members`: where each rank holds
    some of the members, (B, M, ...) -> (B, E, ...), all of them (differentiable)."""

    def __init__(self, row_weights: torch.Tensor, alpha: float,
                 sum_over_grid: SumOverGrid | None = None,
                 gather_members: GatherMembers | None = None):
        super().__init__()
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"crps alpha must be in [0, 1], got {alpha}")
        self.register_buffer("row_weights", row_weights.float(), persistent=False)
        self.alpha, self.sum_over_grid = float(alpha), sum_over_grid
        self.gather_members = gather_members

    def current_alpha(self) -> float:
        """The alpha this mode scores with: the training one, or 1 (fair) in eval mode."""
        return self.alpha if self.training else 1.0

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.gather_members is not None:
            pred = self.gather_members(pred)
        if pred.dim() != target.dim() + 1 or pred.shape[2:] != target.shape[1:]:
            raise ConfigError(f"loss 'crps' scores ensembles: predictions (B, E, C, H, W) and "
                              f"targets (B, C, H, W), got {tuple(pred.shape)} and "
                              f"{tuple(target.shape)}")
        if pred.shape[1] < 2:
            raise ConfigError(f"loss 'crps' needs at least 2 ensemble members per sample, got "
                              f"{pred.shape[1]}")
        crps = almost_fair_crps(pred, target, self.current_alpha())
        return weighted_grid_mean(crps, self.row_weights, self.sum_over_grid)


# The config's `loss` -> the loss of fields with these rows' weights, on a grid whose sums
# `sum_over_grid` completes (None: the fields are the whole grid), with the config's
# `crps_alpha` and the members gathered by `gather_members` (both used by `crps` only).
LOSSES: dict[str, Callable[..., nn.Module]] = {
    "relative_l2": lambda row_weights, sum_over_grid, alpha, gather: RelativeL2Loss(
        sum_over_grid),
    "weighted_mse": lambda row_weights, sum_over_grid, alpha, gather: LatitudeWeightedMSE(
        row_weights, sum_over_grid),
    "crps": lambda row_weights, sum_over_grid, alpha, gather: EnsembleCRPS(
        row_weights, alpha, sum_over_grid, gather),
}


def build_loss(name: str, row_weights: torch.Tensor,
               sum_over_grid: SumOverGrid | None = None,
               crps_alpha: float | None = None,
               gather_members: GatherMembers | None = None) -> nn.Module:
    """The loss `name` (the config's `loss`) of (B, C, rows, columns) fields ((B, E, C, rows,
    columns) predictions for `crps`) whose rows have `row_weights` (the whole grid's
    latitude weights, or a tile's rows of them); `crps_alpha`: the config's (None: the
    schema's default); `gather_members`: the layout's, where ranks hold some of the members
    of each sample (None: each holds all of them)."""
    if crps_alpha is None:
        crps_alpha = Config.model_fields["crps_alpha"].default
    return LOSSES[name](row_weights, sum_over_grid, crps_alpha, gather_members)
