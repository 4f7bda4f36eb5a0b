"""evaluation/scores.py against direct float64 numpy implementations.

The torch code computes in float32; on O(1) random data its results agree with the float64
references to rtol 1e-5 / atol 1e-6 (float32 has ~7 significant digits; the sums here have
at most a few thousand terms).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from evaluation.scores import (
    l2_loss,
    latitude_weights,
    latitudes,
    weighted_acc_channels,
    weighted_rmse_channels,
)

RTOL, ATOL = 1e-5, 1e-6
B, C, H, W = 3, 4, 17, 24  # odd H: a row on the equator


def np_weights(h: int) -> np.ndarray:
    lat = np.deg2rad(np.linspace(90.0, -90.0, h))
    w = np.cos(lat)
    return (w / w.mean())[:, None]


def np_l2(pred: np.ndarray, tar: np.ndarray) -> float:
    b = pred.shape[0]
    d, t = (pred - tar).reshape(b, -1), tar.reshape(b, -1)
    return float(np.mean(np.sqrt((d**2).sum(1)) / np.sqrt((t**2).sum(1))))


def np_rmse(pred: np.ndarray, tar: np.ndarray) -> np.ndarray:
    w = np_weights(pred.shape[-2])
    return np.sqrt((w * (pred - tar) ** 2).mean(axis=(-1, -2)))


def np_acc(pred: np.ndarray, tar: np.ndarray, clim: np.ndarray) -> np.ndarray:
    w = np_weights(pred.shape[-2])
    ap, at = pred - clim, tar - clim
    return (w * ap * at).sum(axis=(-1, -2)) / np.sqrt(
        (w * ap**2).sum(axis=(-1, -2)) * (w * at**2).sum(axis=(-1, -2)))


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


def test_weighted_rmse_channels_matches_numpy(data):
    pred, tar, _ = data
    got = weighted_rmse_channels(t(pred), t(tar))
    assert got.shape == (B, C)
    np.testing.assert_allclose(got.double().numpy(), np_rmse(pred, tar), rtol=RTOL, atol=ATOL)


def test_weighted_acc_channels_matches_numpy(data):
    pred, tar, clim = data
    got = weighted_acc_channels(t(pred), t(tar), t(clim))
    assert got.shape == (B, C)
    np.testing.assert_allclose(got.double().numpy(), np_acc(pred, tar, clim), rtol=RTOL,
                               atol=ATOL)
    assert (got.abs() <= 1 + 1e-6).all()


def test_perfect_prediction_has_rmse_0_and_acc_1(data):
    _, tar, clim = data
    assert torch.equal(weighted_rmse_channels(t(tar), t(tar)), torch.zeros(B, C))
    acc = weighted_acc_channels(t(tar), t(tar), t(clim))
    torch.testing.assert_close(acc, torch.ones(B, C), rtol=0, atol=1e-6)


def test_anticorrelated_anomalies_have_acc_minus_1(data):
    _, tar, clim = data
    mirrored = 2 * clim - tar  # anomaly -(tar - clim)
    acc = weighted_acc_channels(t(mirrored), t(tar), t(clim))
    torch.testing.assert_close(acc, -torch.ones(B, C), rtol=0, atol=1e-5)


def test_rmse_of_a_constant_error_is_that_constant():
    pred = torch.full((1, 2, H, W), 3.0)
    torch.testing.assert_close(weighted_rmse_channels(pred, torch.ones(1, 2, H, W)),
                               torch.full((1, 2), 2.0))


@pytest.mark.parametrize("h", [2, 16, 17, 64, 360])
def test_latitude_weights_have_mean_1_are_symmetric_and_match_numpy(h):
    w = latitude_weights(h)
    assert w.shape == (h, 1) and w.dtype == torch.float32
    assert w.mean().item() == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(w, torch.flip(w, dims=[0]), rtol=0, atol=1e-6)
    np.testing.assert_allclose(w.double().numpy(), np_weights(h), rtol=RTOL, atol=ATOL)
    assert (w >= 0).all()


def test_latitudes_run_from_north_to_south_pole_and_the_poles_weigh_nothing():
    lat = latitudes(17)
    assert lat[0].item() == 90.0 and lat[-1].item() == -90.0 and lat[8].item() == 0.0
    assert (lat[1:] < lat[:-1]).all()
    w = latitude_weights(17)[:, 0]
    assert w[0].item() == pytest.approx(0.0, abs=1e-6) and w.argmax().item() == 8
