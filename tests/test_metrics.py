"""evaluation/scores.py, evaluation/regions.py and the losses (networks/loss.py) against
direct float64 numpy implementations, and the latitude weights of every grid the test suite
uses against WeatherBench-2's formula.

The torch code computes in float32; on O(1) random data its results agree with the float64
references to rtol 1e-5 / atol 1e-6 (float32 has ~7 significant digits; the sums here have
at most a few thousand terms).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import TINY_IMG_SIZE, lat_weights, weighted_rmse_channels

from data.grid import Grid, crop_to, tutorial_grid
from data.planet import grid_of
from evaluation.regions import REGIONS, cell_areas, latitude_weights, region_weights
from evaluation.scores import (
    weighted_acc_channels,
    weighted_mse_channels,
)
from networks.loss import LOSSES, build_loss, l2_loss
from utils.config_schema import Config, expected

RTOL, ATOL = 1e-5, 1e-6
B, C, H, W = 3, 4, 17, 24  # odd H: a row on the equator
GRID = tutorial_grid(H, W)  # 17 rows from pole to pole


def wb2_weights(latitudes: np.ndarray) -> np.ndarray:
    """WeatherBench-2's `get_lat_weights` on ascending latitudes (its requirement), mapped
    back to the rows' order: cell bounds halfway between rows and at the poles, areas
    sin(upper) - sin(lower), normalised to mean 1."""
    order = np.argsort(latitudes)
    x = np.deg2rad(np.asarray(latitudes, dtype=np.float64)[order])
    bounds = np.concatenate([[-np.pi / 2], (x[:-1] + x[1:]) / 2, [np.pi / 2]])
    assert (np.diff(bounds) > 0).all()
    areas = np.sin(bounds[1:]) - np.sin(bounds[:-1])
    weights = np.empty_like(areas)
    weights[order] = areas / areas.mean()
    return weights


# Every grid the suite reads or scores: the synthetic data sets (tiny, the CPU configs', the
# full-size configs'), ERA5 (0.25 degrees; the tutorial's 720-row crop), WeatherBench-2's
# 1.5 degree grid with poles (ascending) and its 5.625 degree grid without poles
# (ascending), the prepared test stores of tests/test_prepare_era5.py (10 degrees with
# poles, cropped to 18 rows, and 5.625 degrees without), and this module's 17 rows.
SUITE_GRIDS = {
    "synthetic tiny 16x32": grid_of(*TINY_IMG_SIZE).latitude,
    "synthetic 64x128": grid_of(64, 128).latitude,
    "synthetic 360x720": grid_of(360, 720).latitude,
    "ERA5 721 rows": np.linspace(90, -90, 721),
    "ERA5 720-row crop": np.linspace(90, -90, 721)[:720],
    "WB2 1.5 deg with poles": np.linspace(-90, 90, 121),
    "WB2 5.625 deg": -87.1875 + 5.625 * np.arange(32),
    "test store 10 deg, 18 rows": np.linspace(90, -90, 19)[:18],
    "test store 5.625 deg, north first": (87.1875 - 5.625 * np.arange(32)),
    "17 rows pole to pole": GRID.latitude,
}


@pytest.mark.parametrize("name", list(SUITE_GRIDS))
def test_latitude_weights_of_every_grid_the_suite_uses_are_weatherbench2s(name):
    lat = np.asarray(SUITE_GRIDS[name], dtype=np.float64)
    got = latitude_weights(Grid(lat, np.arange(4.0)))
    np.testing.assert_allclose(got, wb2_weights(lat), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(got, lat_weights(list(lat)), rtol=1e-12, atol=1e-15)
    assert got.mean() == pytest.approx(1.0, abs=1e-12) and (got > 0).all()


def test_the_synthetic_grid_is_the_one_its_generator_simulates():
    """Rows at 90 - 180 i / H: the north pole is a row, the south pole is not, and the last
    row weighs its cell's area (not 0, as cos(linspace(90, -90, H)) had it)."""
    lat = grid_of(64, 128).latitude
    np.testing.assert_allclose(lat, 90.0 - 180.0 * np.arange(64) / 64)
    w = latitude_weights(grid_of(64, 128))
    assert w[-1] == pytest.approx(wb2_weights(lat)[-1]) and w[-1] > 0.05
    assert w[0] < w[-1]  # the polar cap cell of the pole row is smaller than the last cell


def test_cell_areas_sum_to_the_sphere_and_do_not_depend_on_row_order():
    lat = np.linspace(90, -90, 19)
    assert cell_areas(lat).sum() == pytest.approx(2.0)  # integral of cos from -pi/2 to pi/2
    np.testing.assert_allclose(cell_areas(lat[::-1]), cell_areas(lat)[::-1], rtol=1e-14)


def test_a_crop_keeps_the_cell_areas_of_the_datas_grid():
    full = tutorial_grid(16, 32)
    crop = crop_to(full, (8, 16), "the test's data")
    expected = cell_areas(full.latitude)[:8]
    np.testing.assert_allclose(latitude_weights(crop), expected / expected.mean(), rtol=1e-14)
    np.testing.assert_array_equal(crop.latitude, full.latitude[:8])


def test_regions_are_weatherbench2s_latitude_bands_with_their_bounds():
    lat = np.linspace(90, -90, 19)  # rows every 10 degrees: 20 and -20 are rows
    names, w = region_weights(Grid(lat, np.arange(4.0)))
    assert names == [r[0] for r in REGIONS] == ["global", "northern-hemisphere", "tropics",
                                                  "southern-hemisphere"]
    inside = {name: w[i] > 0 for i, name in enumerate(names)}
    np.testing.assert_array_equal(lat[inside["northern-hemisphere"]], lat[lat >= 20])
    np.testing.assert_array_equal(lat[inside["tropics"]], [20, 10, 0, -10, -20])
    np.testing.assert_array_equal(lat[inside["southern-hemisphere"]], lat[lat <= -20])
    np.testing.assert_allclose(w.sum(axis=1), len(lat))  # sum(w x) / (H W): a mean


def test_a_band_without_rows_is_not_scored():
    names, w = region_weights(crop_to(tutorial_grid(16, 32), (4, 32), "the test's data"))
    assert names == ["global", "northern-hemisphere"] and w.shape == (2, 4)


def np_l2(pred: np.ndarray, tar: np.ndarray) -> float:
    b = pred.shape[0]
    d, t = (pred - tar).reshape(b, -1), tar.reshape(b, -1)
    return float(np.mean(np.sqrt((d**2).sum(1)) / np.sqrt((t**2).sum(1))))


def np_mse(pred: np.ndarray, tar: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted mean over the rows with w > 0 (every column) of the squared error."""
    w = w[:, None]
    return ((w * (pred - tar) ** 2).sum(axis=(-1, -2)) / (w.sum() * pred.shape[-1]))


def np_acc(pred: np.ndarray, tar: np.ndarray, clim: np.ndarray, w: np.ndarray) -> np.ndarray:
    w = w[:, None]
    ap, at = pred - clim, tar - clim
    return (w * ap * at).sum(axis=(-1, -2)) / np.sqrt(
        (w * ap**2).sum(axis=(-1, -2)) * (w * at**2).sum(axis=(-1, -2)))


def weights() -> torch.Tensor:
    return torch.from_numpy(latitude_weights(GRID)).float()


@pytest.fixture
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    tar = rng.standard_normal((B, C, H, W))
    pred = tar + 0.5 * rng.standard_normal((B, C, H, W))
    clim = 0.3 * rng.standard_normal((1, C, H, W))
    # float32 is what the model produces; the references see exactly the same numbers
    return tuple(a.astype(np.float32).astype(np.float64) for a in (pred, tar, clim))


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.float32))


def test_l2_loss_matches_numpy(data):
    pred, tar, _ = data
    got = l2_loss(t(pred), t(tar))
    assert got.shape == () and got.dtype == torch.float32
    assert got.item() == pytest.approx(np_l2(pred, tar), rel=RTOL, abs=ATOL)


def test_l2_loss_is_relative_and_averaged_per_sample():
    tar = torch.ones(2, 1, 2, 2)
    pred = tar.clone()
    pred[0] += 1.0  # sample 0: error norm 2 / target norm 2 = 1; sample 1: 0
    assert l2_loss(pred, tar).item() == pytest.approx(0.5)
    assert l2_loss(10 * pred, 10 * tar).item() == pytest.approx(0.5)  # scale-free


def test_l2_loss_of_low_precision_inputs_is_computed_in_fp32(data):
    pred, tar, _ = data
    got = l2_loss(t(pred).bfloat16(), t(tar).bfloat16())
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(np_l2(pred, tar), rel=2e-2)  # bf16 rounding of inputs


def test_the_latitude_weighted_mse_loss_is_the_mean_of_the_weighted_mse_score(data):
    pred, tar, _ = data
    loss = build_loss("weighted_mse", weights())
    got = loss(t(pred), t(tar))
    assert got.shape == () and got.dtype == torch.float32
    w = latitude_weights(GRID)
    assert got.item() == pytest.approx(np_mse(pred, tar, w).mean(), rel=RTOL, abs=ATOL)
    assert got.item() == pytest.approx(weighted_mse_channels(t(pred), t(tar), weights())
                                       .mean().item(), rel=RTOL)
    # bf16 predictions (autocast): computed in fp32, gradient back in the prediction's dtype
    low = t(pred).bfloat16().requires_grad_()
    value = loss(low, t(tar))
    assert value.dtype == torch.float32
    value.backward()
    assert low.grad.dtype == torch.bfloat16
    # d/d pred of mean(w (pred - tar)^2) = 2 w (pred - tar) / N
    exact = 2 * w[:, None] * (low.detach().double().numpy() - tar) / pred.size
    np.testing.assert_allclose(low.grad.double().numpy(), exact, rtol=1e-2, atol=1e-7)


def test_every_loss_the_config_offers_is_built_and_the_default_is_the_tutorials():
    names = expected("loss")
    assert names == "one of " + ", ".join(repr(n) for n in LOSSES), (names, list(LOSSES))
    assert Config.model_fields["loss"].default == "relative_l2"
    pred, tar = torch.randn(2, 3, H, W), torch.randn(2, 3, H, W)
    assert build_loss("relative_l2", weights())(pred, tar).item() == \
        pytest.approx(l2_loss(pred, tar).item())


def test_weighted_mse_and_rmse_match_numpy(data):
    pred, tar, _ = data
    w = latitude_weights(GRID)
    got = weighted_mse_channels(t(pred), t(tar), weights())
    assert got.shape == (B, C)
    np.testing.assert_allclose(got.double().numpy(), np_mse(pred, tar, w), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(weighted_rmse_channels(t(pred), t(tar), weights()).double(),
                               np.sqrt(np_mse(pred, tar, w)), rtol=RTOL, atol=ATOL)


def test_regional_scores_are_weighted_means_over_the_bands_rows(data):
    pred, tar, clim = data
    names, w = region_weights(GRID)
    mse = weighted_mse_channels(t(pred), t(tar), torch.from_numpy(w).float())
    acc = weighted_acc_channels(t(pred), t(tar), t(clim), torch.from_numpy(w).float())
    assert mse.shape == acc.shape == (B, len(names), C)
    areas = cell_areas(GRID.latitude)
    for r, (name, south, north) in enumerate(REGIONS):
        band = np.where((GRID.latitude >= south) & (GRID.latitude <= north), areas, 0.0)
        np.testing.assert_allclose(mse[:, r].double(), np_mse(pred, tar, band), rtol=RTOL,
                                   atol=ATOL, err_msg=name)
        np.testing.assert_allclose(acc[:, r].double(), np_acc(pred, tar, clim, band),
                                   rtol=RTOL, atol=ATOL, err_msg=name)


def test_weighted_acc_channels_matches_numpy(data):
    pred, tar, clim = data
    got = weighted_acc_channels(t(pred), t(tar), t(clim), weights())
    assert got.shape == (B, C)
    np.testing.assert_allclose(got.double().numpy(),
                               np_acc(pred, tar, clim, latitude_weights(GRID)), rtol=RTOL,
                               atol=ATOL)
    assert (got.abs() <= 1 + 1e-6).all()


def test_perfect_prediction_has_rmse_0_and_acc_1(data):
    _, tar, clim = data
    assert torch.equal(weighted_rmse_channels(t(tar), t(tar), weights()), torch.zeros(B, C))
    acc = weighted_acc_channels(t(tar), t(tar), t(clim), weights())
    torch.testing.assert_close(acc, torch.ones(B, C), rtol=0, atol=1e-6)


def test_anticorrelated_anomalies_have_acc_minus_1_and_no_anomaly_acc_0(data):
    _, tar, clim = data
    mirrored = 2 * clim - tar  # anomaly -(tar - clim)
    acc = weighted_acc_channels(t(mirrored), t(tar), t(clim), weights())
    torch.testing.assert_close(acc, -torch.ones(B, C), rtol=0, atol=1e-5)
    climatology = np.broadcast_to(clim, tar.shape)
    assert torch.equal(weighted_acc_channels(t(climatology), t(tar), t(clim), weights()),
                       torch.zeros(B, C))
    nan = torch.full((1, C, H, W), float("nan"))  # a diverged forecast stays NaN
    assert weighted_acc_channels(nan, t(tar[:1]), t(clim), weights()).isnan().all()


def test_rmse_of_a_constant_error_is_that_constant():
    pred = torch.full((1, 2, H, W), 3.0)
    torch.testing.assert_close(weighted_rmse_channels(pred, torch.ones(1, 2, H, W), weights()),
                               torch.full((1, 2), 2.0))
