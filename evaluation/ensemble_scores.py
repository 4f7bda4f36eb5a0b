"""Ensemble forecast skill as WeatherBench-2 scores ensembles: CRPS with its skill and spread
terms, ensemble-mean RMSE, spread, spread/skill ratios and rank histograms, per region, lead
time and channel.

An ensemble forecast is (B, E, L+1, C, H, W): B initial conditions, E members on dim 1 (as
the `crps` loss's predictions, networks/loss.py), leads 0..L, normalised fields; its truth
is (B, L+1, C, H, W). For each initial condition a score's pointwise value is averaged over
the grid with each region's latitude weights (evaluation/scores.py: also on a spatial tile);
`ensemble_sums` adds these means over a batch of initial conditions, to be added over batches
and data-parallel ranks, and `ensemble_skill_from_sums` divides by their number and forms the
scores (WeatherBench-2's metric in brackets; x_i the members, y the truth, m their mean):

    crps_skill          (1/E) sum_i |x_i - y|                        (CRPSSkill, E|X - Y|)
    crps_spread         sum_{i != j} |x_i - x_j| / (E (E - 1))       (CRPSSpread, E|X - X'|)
    crps                crps_skill - crps_spread / 2: the fair CRPS  (CRPS; one member: MAE)
    ensemble_mean_rmse  sqrt(mean over ICs of the mean of (m - y)^2) (EnsembleMeanMSE)
    spread              sqrt(mean over ICs of the mean of the members' variance, ddof 1)
                                                                     (EnsembleVariance)
    spread_skill_ratio            spread / ensemble_mean_rmse, WeatherBench-2's plain ratio
    spread_skill_ratio_corrected  spread sqrt((E + 1) / E) / ensemble_mean_rmse

Square roots come after the mean over initial conditions, as for the deterministic RMSE. The
two ratios differ by the finite ensemble: if the truth and E members are drawn independently
from one distribution of variance s^2, the expected variance is s^2 and the expected squared
error of the mean s^2 (1 + 1/E), so the plain ratio of a perfect ensemble reads
sqrt(E / (E + 1)) (0.89 at E = 4) and the corrected one 1. Physical units: the scores times
the channel's std (the ratios have none); a ratio whose RMSE is 0 (lead 0 of unperturbed
members) is NaN. One member: both spreads are 0 and the CRPS is the MAE.

Rank histograms: the rank of the truth among the members at a point is the number of members
below it (0..E, E + 1 bins). Ties (a clipped field, identical members) are placed by a seeded
rule: a truth equal to t members takes the ranks below + 0..t with equal probability, drawn
as floor(u (t + 1)) from u uniform in [0, 1), one per grid point of the whole grid, from
numpy's generator seeded with (seed, the initial condition's key, the lead's position, the
channel): the same histogram on any tiling of the grid and any batching. `rank_histogram_sums`
adds each bin's latitude-weighted fraction of the grid over initial conditions; divided by
their number, the bins of a region, lead and channel sum to 1, and a calibrated ensemble's
are flat (1 / (E + 1) each). Lead 0 is for the caller to drop (members that start from the
truth rank it by their ties alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from evaluation.scores import weighted_mean_channels
from networks.loss import member_spread_sum
from utils.tile import Tile

SUMS = ("crps_skill", "crps_spread", "ensemble_mean_mse", "ensemble_variance")
SCORES = ("crps", "crps_skill", "crps_spread", "ensemble_mean_rmse", "spread",
          "spread_skill_ratio", "spread_skill_ratio_corrected")


def _check(members: torch.Tensor, truth: torch.Tensor) -> None:
    if members.dim() != truth.dim() + 1 or members.shape[:1] + members.shape[2:] != truth.shape:
        raise ValueError(f"an ensemble (B, E, ...) and its truth (B, ...) expected, got "
                         f"{tuple(members.shape)} and {tuple(truth.shape)}")


def pointwise_terms(members: torch.Tensor, truth: torch.Tensor) -> list[torch.Tensor]:
    """The four `SUMS` at every point, fp32, each of the truth's shape."""
    _check(members, truth)
    E = members.shape[1]
    x, y = members.float(), truth.float()
    skill = (x - y.unsqueeze(1)).abs().mean(dim=1)
    error = (x.mean(dim=1) - y).square()
    if E == 1:
        return [skill, torch.zeros_like(y), error, torch.zeros_like(y)]
    spread = member_spread_sum(x, dim=1) / (E * (E - 1))
    return [skill, spread, error, x.var(dim=1, correction=1)]


@torch.no_grad()
def ensemble_sums(members: torch.Tensor, truth: torch.Tensor, weights: torch.Tensor,
                  tile: Tile | None = None) -> torch.Tensor:
    """float64 (4 `SUMS`, R, L+1, C): each term's latitude-weighted mean over the grid,
    summed over the B initial conditions. members (B, E, L+1, C, H, W), truth
    (B, L+1, C, H, W); weights: the whole grid's region weights (R, H) (or (H,): R = 1);
    with a `tile`, the fields are this rank's tile and the means those of the whole grid
    (collectives over "h-w")."""
    weights = weights if weights.dim() == 2 else weights[None]
    terms = pointwise_terms(members, truth)
    # (B, L+1, R, C) per term -> summed over B -> (R, L+1, C)
    return torch.stack([weighted_mean_channels(t, weights, tile).double().sum(0).transpose(0, 1)
                        for t in terms])


@dataclass
class EnsembleSkill:
    """Every score of `SCORES` (name -> (R regions, L+1 leads, C channels), physical units)."""

    lead_hours: list[int]
    channels: list[str]
    regions: list[str]
    ensemble_size: int
    n_initial_conditions: int
    scores: dict[str, np.ndarray]

    def series(self, score: str, channel: str, region: str = "global") -> np.ndarray:
        """A score by lead time, e.g. ('crps', 'z500')."""
        return self.scores[score][self.regions.index(region), :, self.channels.index(channel)]


def ensemble_skill_from_sums(sums: torch.Tensor, count: int, stds: Sequence[float],
                             ensemble_size: int, lead_hours: Sequence[int],
                             channels: Sequence[str], regions: Sequence[str]) -> EnsembleSkill:
    """The scores (module docstring) from the (all-reduced) `ensemble_sums` of `count`
    initial conditions; `stds` (C,) turn normalised units into physical ones."""
    s = sums.detach().cpu().double().numpy() / count
    std = np.asarray(stds, dtype=np.float64).reshape(1, 1, -1)
    skill, pairs = s[0] * std, s[1] * std
    rmse, spread = np.sqrt(s[2]) * std, np.sqrt(s[3]) * std
    safe = np.where(rmse > 0, rmse, 1.0)
    ratio = np.where(rmse > 0, spread / safe, np.nan)
    E = ensemble_size
    scores = {"crps": skill - 0.5 * pairs, "crps_skill": skill, "crps_spread": pairs,
              "ensemble_mean_rmse": rmse, "spread": spread, "spread_skill_ratio": ratio,
              "spread_skill_ratio_corrected": ratio * np.sqrt((E + 1) / E)}
    return EnsembleSkill(list(lead_hours), list(channels), list(regions), E, count, scores)


def truth_ranks(members: torch.Tensor, truth: torch.Tensor, keys: Sequence[int], seed: int = 0,
                tile: Tile | None = None, first_lead: int = 0) -> torch.Tensor:
    """The truth's rank among the members at every point (int64, the truth's shape), ties
    placed by the seeded rule (module docstring); arguments as `rank_histogram_sums`'s."""
    _check(members, truth)
    tile = tile if tile is not None else Tile.whole(truth.shape[-2:])
    members, truth = members.float(), truth.float()
    below = (members < truth.unsqueeze(1)).sum(dim=1)
    ties = (members == truth.unsqueeze(1)).sum(dim=1)
    ranks = below.clone()
    tied = torch.nonzero(ties.flatten(3).any(dim=-1)).tolist()  # [(b, lead, c)] with ties
    for b, lead, c in tied:  # the whole grid's draws, this tile's part of them
        rng = np.random.default_rng([seed, int(keys[b]), first_lead + lead, c])
        u = torch.from_numpy(rng.random(tile.grid)[tile.rows, tile.cols]).to(ties.device)
        ranks[b, lead, c] += torch.floor(u * (ties[b, lead, c] + 1)).long()
    return ranks


@torch.no_grad()
def rank_histogram_sums(members: torch.Tensor, truth: torch.Tensor, weights: torch.Tensor,
                        keys: Sequence[int], seed: int = 0, tile: Tile | None = None,
                        first_lead: int = 0) -> torch.Tensor:
    """float64 (R, L, C, E + 1): each bin's latitude-weighted fraction of the grid, summed
    over the B initial conditions. members (B, E, L, C, H, W) and truth (B, L, C, H, W) at
    the leads to score (lead 0 dropped); `keys` (B,) non-negative integers naming the
    initial conditions (e.g. their times in hours since 1970) and `seed`: the draws that
    place ties (module docstring); weights and tile as in `ensemble_sums`; `first_lead`:
    the position of the first lead given (a rollout scored lead by lead passes each lead's
    own, so that its draws are those of the whole rollout's)."""
    weights = weights if weights.dim() == 2 else weights[None]
    ranks = truth_ranks(members, truth, keys, seed, tile, first_lead)
    bins = [weighted_mean_channels((ranks == k).float(), weights, tile).double().sum(0)
            for k in range(members.shape[1] + 1)]  # each (L, R, C)
    return torch.stack(bins, dim=-1).transpose(0, 1)
