"""evaluation/ensemble_scores.py against WeatherBench-2's ensemble metrics written out
independently here in float64 with xarray, on forecasts with a `realization` dimension
(CRPSSkill, CRPSSpread, CRPS, EnsembleMeanMSE, EnsembleVariance, each averaged over the
grid with area weights, then over initial times, square roots last), against the loss's
fair CRPS, and for an ensemble drawn from the truth's own distribution (spread/skill and rank
histograms). Rank histograms also against a loop that applies the documented tie rule.

The torch code averages each initial condition's fields in float32: agreement with the
float64 references to rtol 1e-5."""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from data.grid import tutorial_grid
from evaluation.ensemble_scores import (
    SCORES,
    ensemble_skill_from_sums,
    ensemble_sums,
    rank_histogram_sums,
    truth_ranks,
)
from evaluation.regions import REGIONS, region_weights
from networks.loss import almost_fair_crps
from utils.tile import Tile

B, E, L1, H, W = 4, 5, 3, 9, 12
CHANNELS, STDS, MEANS = ["z500", "t850"], [800.0, 4.0], [5.5e4, 270.0]
GRID = tutorial_grid(H, W)  # rows from 90 towards -90, as the data's


def _fields(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised members (B, E, L+1, C, H, W), biased and spreading with lead, and truth."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(B, L1, len(CHANNELS), H, W, generator=g)
    grow = torch.arange(L1, dtype=torch.float32).view(1, 1, L1, 1, 1, 1)
    noise = torch.randn(B, E, L1, len(CHANNELS), H, W, generator=g)
    return truth[:, None] + 0.2 + (0.3 + 0.4 * grow) * noise, truth


def _datasets(members: torch.Tensor, truth: torch.Tensor) -> tuple[xr.Dataset, xr.Dataset]:
    """WeatherBench-2's layout, physical units, float64."""
    coords = {"time": np.arange(B), "realization": np.arange(E),
              "prediction_timedelta": np.arange(L1) * np.timedelta64(6, "h"),
              "latitude": GRID.latitude, "longitude": GRID.longitude}
    fc_dims = ["time", "realization", "prediction_timedelta", "latitude", "longitude"]
    m, t = members.double().numpy(), truth.double().numpy()
    fc = xr.Dataset({n: (fc_dims, m[:, :, :, c] * STDS[c] + MEANS[c])
                     for c, n in enumerate(CHANNELS)}, coords=coords)
    tr = xr.Dataset({n: (fc_dims[:1] + fc_dims[2:], t[:, :, c] * STDS[c] + MEANS[c])
                     for c, n in enumerate(CHANNELS)},
                    coords={k: v for k, v in coords.items() if k != "realization"})
    return fc, tr


def _area_mean(ds: xr.Dataset, south: float, north: float) -> xr.Dataset:
    """WeatherBench-2's spatial average over a latitude band: latitudes made ascending,
    cell-area weights (bounds halfway between rows, and the poles), mean 1, zero outside."""
    ds = ds.sortby("latitude")
    lat = np.deg2rad(ds.latitude.values)
    bounds = np.concatenate([[-np.pi / 2], (lat[:-1] + lat[1:]) / 2, [np.pi / 2]])
    area = np.sin(bounds[1:]) - np.sin(bounds[:-1])
    weights = xr.DataArray(area / area.mean(), coords={"latitude": ds.latitude})
    inside = (ds.latitude >= south) & (ds.latitude <= north)
    return ds.weighted(weights.where(inside, 0.0)).mean(["latitude", "longitude"])


def wb2_scores(fc: xr.Dataset, tr: xr.Dataset, south: float, north: float) -> dict:
    n = fc.sizes["realization"]
    pairs = sum(abs(fc.isel(realization=i) - fc.isel(realization=j))
                for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    skill = _area_mean(abs(fc - tr).mean("realization"), south, north).mean("time")
    spread = _area_mean(pairs, south, north).mean("time")
    mse = _area_mean((tr - fc.mean("realization")) ** 2, south, north).mean("time")
    var = _area_mean(fc.var("realization", ddof=1), south, north).mean("time")
    rmse, sd = np.sqrt(mse), np.sqrt(var)
    return {"crps": skill - 0.5 * spread, "crps_skill": skill, "crps_spread": spread,
            "ensemble_mean_rmse": rmse, "spread": sd, "spread_skill_ratio": sd / rmse,
            "spread_skill_ratio_corrected": sd * np.sqrt((n + 1) / n) / rmse}


def test_every_score_equals_weatherbench2s_definition_in_every_region() -> None:
    members, truth = _fields()
    names, weights = region_weights(GRID)
    w = torch.from_numpy(weights).float()
    # Sums over two batches of initial conditions add up to those of all of them.
    sums = ensemble_sums(members[:1], truth[:1], w) + ensemble_sums(members[1:], truth[1:], w)
    torch.testing.assert_close(sums, ensemble_sums(members, truth, w), rtol=1e-6, atol=1e-9)
    skill = ensemble_skill_from_sums(sums, B, STDS, E, [0, 6, 12], CHANNELS, names)
    fc, tr = _datasets(members, truth)
    assert names == [r[0] for r in REGIONS]
    for name, south, north in REGIONS:
        want = wb2_scores(fc, tr, south, north)
        for score in SCORES:
            for c in CHANNELS:
                np.testing.assert_allclose(skill.series(score, c, name), want[score][c].values,
                                           rtol=1e-5, err_msg=f"{score} {c} {name}")


def test_the_crps_is_the_losss_fair_crps_and_one_members_is_its_mae() -> None:
    members, truth = _fields(1)
    w = torch.from_numpy(region_weights(GRID)[1][:1]).float()
    skill = ensemble_skill_from_sums(ensemble_sums(members, truth, w), B, [1.0, 1.0], E,
                                     [0, 6, 12], CHANNELS, ["global"])
    per_ic = almost_fair_crps(members, truth, alpha=1.0)  # (B, L+1, C, H, W)
    fair = (per_ic.double().mean(dim=(0, -1)) * w[0].double()).mean(dim=-1)  # (L+1, C)
    np.testing.assert_allclose(skill.scores["crps"][0], fair.numpy(), rtol=1e-5)
    one = ensemble_skill_from_sums(ensemble_sums(members[:, :1], truth, w), B, [1.0, 1.0], 1,
                                   [0, 6, 12], CHANNELS, ["global"])
    mae = ((members[:, 0] - truth).abs().double().mean(dim=(0, -1)) * w[0].double()).mean(-1)
    np.testing.assert_allclose(one.scores["crps"][0], mae.numpy(), rtol=1e-5)
    assert (one.scores["crps_spread"] == 0).all() and (one.scores["spread"] == 0).all()


def test_a_perfect_ensembles_corrected_spread_skill_is_1_and_the_plain_one_is_not() -> None:
    """Truth and 4 members drawn independently from N(0, 1) at 64 x 16 x 32 points per lead:
    the corrected ratio is 1 and the plain one sqrt(4/5) = 0.894, within 3 % (the estimate's
    standard error is ~0.6 %); the rank histogram is flat within 0.02 of 1/5."""
    g = torch.Generator().manual_seed(2)
    n, e, grid = 64, 4, tutorial_grid(16, 32)
    truth = torch.randn(n, 2, 1, 16, 32, generator=g)
    members = torch.randn(n, e, 2, 1, 16, 32, generator=g)
    w = torch.from_numpy(region_weights(grid)[1][:1]).float()
    skill = ensemble_skill_from_sums(ensemble_sums(members, truth, w), n, [1.0], e, [6, 12],
                                     ["x"], ["global"])
    np.testing.assert_allclose(skill.series("spread_skill_ratio_corrected", "x"), 1.0,
                               rtol=0.03)
    np.testing.assert_allclose(skill.series("spread_skill_ratio", "x"), np.sqrt(e / (e + 1)),
                               rtol=0.03)
    hist = rank_histogram_sums(members, truth, w, keys=range(n)) / n
    assert hist.shape == (1, 2, 1, e + 1)
    np.testing.assert_allclose(hist.sum(-1).numpy(), 1.0, rtol=1e-6)
    np.testing.assert_allclose(hist.numpy(), 1 / (e + 1), atol=0.02)
    # An under-dispersed ensemble (spread 0.3 for a truth of spread 1): a U-shaped histogram.
    narrow = rank_histogram_sums(0.3 * members, truth, w, keys=range(n))[0, 0, 0] / n
    assert narrow[0] > 0.3 and narrow[-1] > 0.3 and narrow[1:-1].max() < 0.15


def test_ties_are_placed_by_the_documented_seeded_rule_on_any_tile() -> None:
    """Members and truth on a coarse grid of values (0.5 apart): many ties. The ranks equal
    a loop that applies the rule as written: below + floor(u (ties + 1)), u from numpy's
    generator seeded with (seed, key, lead, channel) over the whole grid; a tile's ranks are
    the whole grid's there; a truth tied with every member (lead 0) ranks uniformly."""
    g = torch.Generator().manual_seed(3)
    truth = torch.round(2 * torch.randn(B, L1, 2, H, W, generator=g)) / 2
    members = torch.round(2 * torch.randn(B, E, L1, 2, H, W, generator=g)) / 2
    keys, seed = [70128 + 6 * b for b in range(B)], 7
    ranks = truth_ranks(members, truth, keys, seed)
    m, t = members.numpy(), truth.numpy()
    for b in range(B):
        for lead in range(L1):
            for c in range(2):
                x, y = m[b, :, lead, c], t[b, lead, c]
                below, ties = (x < y).sum(0), (x == y).sum(0)
                u = np.random.default_rng([seed, keys[b], lead, c]).random((H, W))
                want = below + np.where(ties > 0, np.floor(u * (ties + 1)), 0)
                np.testing.assert_array_equal(ranks[b, lead, c].numpy(), want)
    tile = Tile((H, W), slice(3, 7), slice(5, 12))
    part = truth_ranks(members[..., 3:7, 5:12], truth[..., 3:7, 5:12], keys, seed, tile)
    assert torch.equal(part, ranks[..., 3:7, 5:12])
    same = truth[:, None].expand(B, E, L1, 2, H, W)
    counts = torch.bincount(truth_ranks(same, truth, keys, seed).flatten(), minlength=E + 1)
    np.testing.assert_allclose(counts.numpy() / counts.sum().item(), 1 / (E + 1), atol=0.02)
    w = torch.from_numpy(region_weights(GRID)[1]).float()
    hist = rank_histogram_sums(members, truth, w, keys, seed)  # (R, L+1, C, E+1)
    names = region_weights(GRID)[0]
    for r in range(len(names)):  # each bin: the region's weighted fraction of the grid
        frac = [(w[r, :, None] * (ranks == k).double().sum(0)).mean(dim=(-2, -1))
                for k in range(E + 1)]
        np.testing.assert_allclose(hist[r].numpy(), torch.stack(frac, -1).numpy(), rtol=1e-5)
