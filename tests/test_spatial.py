"""Tiles of a field over the h x w mesh (distributed.spatial) and the losses and skill
scores computed from tiles (every loss of networks/loss.py with the spatial layout's sums
over the tiles, evaluation.scores's scores given a Tile) against the serial ones on the
whole field: each loss and its gradient, latitude-weighted RMSE and ACC, and the whole
field put back together.

Tolerance: max |err| <= 1e-5 x max |serial|: the tiles' sums add the same terms in another
order (fp32 round-off ~1e-7 relative).
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    CONFIG_FILE,
    assert_close_rel,
    layout_of,
    run_distributed,
    weighted_rmse_channels,
)
from sharded import gather_image, scatter_image

from data.grid import tutorial_grid
from distributed import comm
from distributed.spatial import tile_bounds
from evaluation.regions import region_weights
from evaluation.scores import weighted_acc_channels, whole_field
from networks.loss import LOSSES, build_loss
from utils.config import read_config
from utils.tile import Tile

RTOL = 1e-5  # of the serial value's largest entry
GRID, PATCH = (7, 9), 4  # 28 x 36 pixels; uneven over 2 and 3 ranks


def _fields() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (2, 3, GRID[0] * PATCH, GRID[1] * PATCH)
    target = torch.randn(shape, generator=g)
    return target + 0.3 * torch.randn(shape, generator=g), target, torch.randn(shape[1:],
                                                                                generator=g)


def _run(h: int, w: int) -> None:
    comm.init(h=h, w=w)
    pred, target, clim = _fields()
    where = f"h={h} w={w}"
    tile = lambda t: scatter_image(t, GRID, PATCH)  # noqa: E731
    rows, cols = tile_bounds(GRID, PATCH)
    assert torch.equal(tile(pred), pred[..., rows, cols])
    assert torch.equal(gather_image(tile(pred), GRID, PATCH), pred), f"{where} round trip"

    cfg = read_config(CONFIG_FILE, "tiny_afno", environ={}).replace(
        img_size=list(pred.shape[-2:]), patch_size=PATCH, h_parallel_size=h,
        w_parallel_size=w)
    layout = layout_of(cfg)
    # Every region's weights of the whole grid; each rank scores its tile's rows of them.
    _, weights = region_weights(tutorial_grid(*pred.shape[-2:]))
    wts = torch.from_numpy(weights).float()
    # An ensemble of 4 members around the prediction, (B, E, C, H, W), for `crps`.
    members = pred[:, None] + 0.3 * torch.randn((pred.shape[0], 4, *pred.shape[1:]),
                                                generator=torch.Generator().manual_seed(1))
    for name in LOSSES:  # each loss, as build_training builds it on this layout
        forecast = members if name == "crps" else pred
        pred_full = forecast.clone().requires_grad_()
        serial = build_loss(name, wts[0])(pred_full, target)
        serial.backward()
        pred_tile = tile(forecast).requires_grad_()
        loss = build_loss(name, wts[0, rows], layout.sum_over_grid)(pred_tile, tile(target))
        loss.backward()
        assert_close_rel(loss.detach(), serial.detach(), f"{where} {name} loss", RTOL)
        assert_close_rel(pred_tile.grad, tile(pred_full.grad), f"{where} {name} gradient",
                         RTOL)

    t = Tile(tuple(pred.shape[-2:]), rows, cols)
    assert_close_rel(weighted_rmse_channels(tile(pred), tile(target), wts, t),
           weighted_rmse_channels(pred, target, wts), f"{where} weighted RMSE", RTOL)
    assert_close_rel(weighted_acc_channels(tile(pred), tile(target), tile(clim), wts, t),
           weighted_acc_channels(pred, target, clim, wts), f"{where} weighted ACC", RTOL)
    assert torch.equal(whole_field(tile(pred), t), pred), f"{where} whole field"


@pytest.mark.distributed
@pytest.mark.parametrize("h,w", [(2, 2), (3, 1)], ids=["h2xw2", "h3"])
def test_loss_and_metrics_from_tiles_equal_the_serial_ones(h: int, w: int) -> None:
    run_distributed(_run, h * w, h, w)


def test_one_rank_tile_is_the_whole_field() -> None:
    comm.reset()
    pred, target, _ = _fields()
    assert tile_bounds(GRID, PATCH) == (slice(0, 28), slice(0, 36))
    assert torch.equal(scatter_image(pred, GRID, PATCH), pred)
    cfg = read_config(CONFIG_FILE, "tiny_afno", environ={}).replace(
        img_size=list(pred.shape[-2:]), patch_size=PATCH)
    one = layout_of(cfg)  # a 1 x 1 mesh is the serial layout
    assert one.kind == "serial" and one.tile.is_whole and one.sum_over_grid is None
