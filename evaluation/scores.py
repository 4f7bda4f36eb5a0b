"""How a forecast is scored: the training loss, latitude-weighted RMSE and anomaly
correlation (ACC) per channel, and `validate` over a data-parallel validation set.

Rows run from +90 (north) to -90 degrees; a row's weight is cos(latitude) normalised to
mean 1, so polar rows (which cover little area) count little.

Every score is a ratio of sums over the grid. Given a `Tile` (spatial parallelism: this
rank holds a block of the grid's rows and columns) the sums run over the tile with the
weights of its own latitudes, one all-reduce over the "h-w" ranks completes them, and every
rank of the mesh gets the score of the whole grid. Without one, the fields are the whole grid.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from distributed import comm
from distributed.layout import Layout
from networks.loss import l2_loss
from utils.config_schema import Config
from utils.data.dataset import load_stats, load_stds
from utils.errors import DataError
from utils.precision import Precision
from utils.tile import Tile


def latitudes(num_lat: int) -> torch.Tensor:
    """Latitude in degrees of each row, +90 .. -90."""
    return torch.linspace(90.0, -90.0, num_lat, dtype=torch.float64)


@functools.lru_cache(maxsize=16)
def latitude_weights(num_lat: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(num_lat, 1) weights, cos(lat) / mean(cos(lat)); made once per grid and device."""
    w = torch.cos(torch.deg2rad(latitudes(num_lat)))
    return (w / w.mean()).to(device=device, dtype=torch.float32).unsqueeze(1)


def _tile_of(x: torch.Tensor, tile: Tile | None) -> Tile:
    return tile if tile is not None else Tile.whole(x.shape[-2:])


def _over_grid(sums: torch.Tensor, tile: Tile) -> torch.Tensor:
    """Sums over a tile -> sums over the grid (collective over "h-w" for a part of it)."""
    return sums if tile.is_whole else comm.sum_over(sums, "h-w")


def _tile_weights(tile: Tile, device: torch.device) -> torch.Tensor:
    """(rows, 1) latitude weights of the global grid at the tile's rows."""
    return latitude_weights(tile.grid[0], device)[tile.rows]


def weighted_mse_channels(pred: torch.Tensor, target: torch.Tensor,
                          tile: Tile | None = None) -> torch.Tensor:
    """(..., C, H, W) -> (..., C): the latitude-weighted mean squared error (of the whole
    grid, also when the fields are a `tile` of it)."""
    tile = _tile_of(pred, tile)
    w = _tile_weights(tile, pred.device)
    sq = torch.sum(w * (pred.float() - target.float()) ** 2, dim=(-1, -2))
    return _over_grid(sq, tile) / (tile.grid[0] * tile.grid[1])


def weighted_rmse_channels(pred: torch.Tensor, target: torch.Tensor,
                           tile: Tile | None = None) -> torch.Tensor:
    """(B, C, H, W) -> (B, C): sqrt of `weighted_mse_channels`."""
    return torch.sqrt(weighted_mse_channels(pred, target, tile))


def weighted_acc_channels(pred: torch.Tensor, target: torch.Tensor,
                          climatology: torch.Tensor, tile: Tile | None = None) -> torch.Tensor:
    """(B, C, H, W) -> (B, C): weighted correlation of anomalies w.r.t. the climatology
    (given on the same grid or tile as the fields)."""
    tile = _tile_of(pred, tile)
    w = _tile_weights(tile, pred.device)
    a_p = pred.float() - climatology
    a_t = target.float() - climatology
    sums = torch.stack([torch.sum(w * a_p * a_t, dim=(-1, -2)),
                        torch.sum(w * a_p**2, dim=(-1, -2)),
                        torch.sum(w * a_t**2, dim=(-1, -2))])
    num, pp, tt = _over_grid(sums, tile)
    return num / torch.sqrt(pp * tt)


@torch.no_grad()
def relative_l2(pred: torch.Tensor, target: torch.Tensor, tile: Tile | None = None
                ) -> torch.Tensor:
    """The training loss (networks.loss.l2_loss) as a score, also of fields split into
    tiles."""
    tile = _tile_of(pred, tile)
    return l2_loss(pred, target, None if tile.is_whole else lambda s: _over_grid(s, tile))


@torch.no_grad()
def whole_field(x: torch.Tensor, tile: Tile | None) -> torch.Tensor:
    """The whole (..., H, W) field from every rank's tile of it (collective over "h-w"):
    each rank adds its tile into zeros. For an example map; not for every batch."""
    tile = _tile_of(x, tile)
    if tile.is_whole:
        return x
    out = x.new_zeros(*x.shape[:-2], *tile.grid)
    out[..., tile.rows, tile.cols] = x
    return comm.sum_over(out, "h-w")


class Normaliser:
    """Per-channel global statistics, to report errors in physical units, and the
    normalised climatology that ACC measures anomalies against."""

    def __init__(self, cfg: Config, device: torch.device):
        C = cfg.n_out_channels
        H, W = cfg.img_size
        # load_stats: a missing file or a wrong shape is a one-line DataError.
        self.means = torch.from_numpy(
            load_stats(cfg.global_means_path, C, "global means")).to(device)
        self.stds = torch.from_numpy(load_stds(cfg.global_stds_path, C)).to(device)
        clim = load_stats(cfg.time_means_path, C, "time means")
        if clim.shape[2] < H or clim.shape[3] < W:
            raise DataError(f"time means {cfg.time_means_path} are {clim.shape[2]}x"
                            f"{clim.shape[3]}, smaller than img_size {H}x{W}")
        clim = torch.from_numpy(clim[:, :, :H, :W]).to(device)
        self.climatology = (clim - self.means) / self.stds  # normalised, for ACC

    def channel(self, c: int) -> tuple[float, float]:
        """(mean, std) of channel `c`, to turn a normalised field back into units."""
        return self.means[0, c].item(), self.stds[0, c].item()


@torch.no_grad()
def validate(model: torch.nn.Module, loader: Any, layout: Layout, precision: Precision,
             norm: Normaliser, max_batches: int | None = None) -> dict[str, Any]:
    """Loss, latitude-weighted RMSE(u10m) in m/s, persistence RMSE and ACC over the
    validation set, summed over the data-parallel ranks and averaged. On a spatial mesh the
    loader and the model hold this rank's tile of every field (the layout's), and the
    scores are those of the whole grid (collectives over "h-w": every rank of the mesh
    calls this)."""
    model.eval()
    tile, device = layout.tile, layout.device
    climatology = norm.climatology[..., tile.rows, tile.cols]
    # [loss x samples, rmse_u10, persistence_u10, acc_u10, acc_t2m], summed over samples
    sums = torch.zeros(5, dtype=torch.float64, device=device)
    samples, first = 0, None
    std = norm.stds[0, :, 0, 0]
    for i, (inp, tar) in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        inp, tar = inp.to(device, non_blocking=True), tar.to(device, non_blocking=True)
        with precision.autocast():
            gen = model(inp)
        gen = gen.float()
        rmse = weighted_rmse_channels(gen, tar, tile) * std
        persist = weighted_rmse_channels(inp, tar, tile) * std
        skill = weighted_acc_channels(gen, tar, climatology, tile)
        sums += torch.stack([relative_l2(gen, tar, tile) * inp.shape[0], rmse[:, 0].sum(),
                             persist[:, 0].sum(), skill[:, 0].sum(), skill[:, 2].sum()]).double()
        samples += inp.shape[0]
        if first is None:  # t2m of the first sample: input, target, forecast, whole grid
            maps = whole_field(torch.stack([inp[0, 2], tar[0, 2], gen[0, 2]]), tile)
            first = tuple(m.cpu().numpy() for m in maps)
    totals = comm.sum_over(torch.cat([sums, sums.new_tensor([samples])]), "dp").tolist()
    n = max(totals[5], 1.0)
    model.train()
    return {"loss": totals[0] / n, "rmse_u10m": totals[1] / n,
            "persistence_rmse_u10m": totals[2] / n, "acc_u10m": totals[3] / n,
            "acc_t2m": totals[4] / n, "samples": n, "example_t2m": first}
