"""How a forecast is scored: latitude-weighted MSE/RMSE and anomaly correlation (ACC) per
channel (and region), and `validate` over a data-parallel validation set (with the run's
training loss, networks/loss.py).

Rows are weighted by the area of their cells on the sphere, computed from the latitudes
the data records (evaluation/regions.py: WeatherBench-2's weights, mean 1). With several
regions the weights are an (R, H) tensor, one row per region, and the scores gain a region
axis before the channel axis.

RMSE is WeatherBench-2's: the square root is taken after the latitude-weighted mean over
the grid and after the mean over samples (initial conditions), never per sample:
    RMSE = sqrt(mean over samples of weighted_mse_channels)
`validate` (training-time) and inference.py (forecast skill) both report this one.

Every score is a ratio of sums over the grid. Given a `Tile` (spatial parallelism: this
rank holds a block of the grid's rows and columns) the sums run over the tile with the
weights of its own rows, one all-reduce over the "h-w" ranks completes them, and every
rank of the mesh gets the score of the whole grid. Without one, the fields are the whole grid.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from data.era5_names import CHANNEL_NAMES
from data.statistics import load_stats, load_stds, score_grid
from distributed import comm
from distributed.layout import Layout
from evaluation.regions import weights_tensor
from networks.ensemble import VALIDATION, Members
from networks.rollout import rollout
from utils.config_schema import Config
from utils.errors import DataError
from utils.precision import Precision
from utils.tile import Tile

# The channels training-time validation reports (the tutorial's): RMSE and ACC of u10, ACC
# and the example map of t2m, by their place in the data contract's channel order.
U10, T2M = CHANNEL_NAMES.index("u10"), CHANNEL_NAMES.index("t2m")


def _tile_of(x: torch.Tensor, tile: Tile | None) -> Tile:
    return tile if tile is not None else Tile.whole(x.shape[-2:])


def _over_grid(sums: torch.Tensor, tile: Tile) -> torch.Tensor:
    """Sums over a tile -> sums over the grid (collective over "h-w" for a part of it)."""
    return sums if tile.is_whole else comm.sum_over(sums, "h-w")


def _weighted_sums(x: torch.Tensor, weights: torch.Tensor, tile: Tile) -> torch.Tensor:
    """(..., C, rows, cols) -> sums of weights x x over the tile: (..., R, C) for (R, H)
    weights of the whole grid's rows, (..., C) for (H,) weights."""
    w = weights[..., tile.rows].to(x.device)
    by_row = x.sum(dim=-1)  # weights vary by row only: sum the columns first
    # Elementwise products and sums, not a matmul: each sample's sum is then the same
    # whatever the batch (a matmul's blocking depends on it), so scores summed over batches
    # and ranks do not depend on how the samples were split.
    if w.dim() == 1:
        return (by_row * w).sum(dim=-1)
    return (by_row.unsqueeze(-3) * w.unsqueeze(-2)).sum(dim=-1)


def weighted_mean_channels(x: torch.Tensor, weights: torch.Tensor,
                           tile: Tile | None = None) -> torch.Tensor:
    """(..., C, H, W) pointwise values -> (..., C) for (H,) `weights`, (..., R, C) for
    (R, H): their latitude-weighted mean over the whole grid, also when `x` is a `tile` of
    it. `weights` are the whole grid's (evaluation/regions.py)."""
    tile = _tile_of(x, tile)
    return _over_grid(_weighted_sums(x, weights, tile), tile) / (tile.grid[0] * tile.grid[1])


def weighted_mse_channels(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor,
                          tile: Tile | None = None) -> torch.Tensor:
    """(..., C, H, W) -> (..., C) for (H,) `weights`, (..., R, C) for (R, H): the
    latitude-weighted mean squared error of the whole grid (`weighted_mean_channels`)."""
    return weighted_mean_channels((pred.float() - target.float()) ** 2, weights, tile)


def weighted_acc_channels(pred: torch.Tensor, target: torch.Tensor,
                          climatology: torch.Tensor, weights: torch.Tensor,
                          tile: Tile | None = None) -> torch.Tensor:
    """(B, C, H, W) -> (B, C) or (B, R, C): weighted correlation of anomalies w.r.t. the
    climatology (given on the same grid or tile as the fields); 0 where the forecast's
    anomaly is zero everywhere (a correlation with nothing: the climatology itself)."""
    tile = _tile_of(pred, tile)
    a_p = pred.float() - climatology
    a_t = target.float() - climatology
    sums = torch.stack([_weighted_sums(a_p * a_t, weights, tile),
                        _weighted_sums(a_p**2, weights, tile),
                        _weighted_sums(a_t**2, weights, tile)])
    num, pp, tt = _over_grid(sums, tile)
    return torch.where(pp == 0, torch.zeros_like(num), num / torch.sqrt(pp * tt))


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
    """Per-channel global statistics, to report errors in physical units; the normalised
    time-mean climatology that training-time ACC measures anomalies against; and the grid
    the config scores (`grid`, cropped to img_size) with its region weights (`regions`,
    `weights` (R, H))."""

    def __init__(self, cfg: Config, device: torch.device):
        C = cfg.n_out_channels
        H, W = cfg.img_size
        # load_stats: a missing file or a wrong shape is a one-line DataError.
        self.means = torch.from_numpy(
            load_stats(cfg.global_means_path, C, "global means")).to(device)
        self.stds = torch.from_numpy(load_stds(cfg.global_stds_path, C)).to(device)
        self.grid = score_grid(cfg)  # img_size larger than the data: DataError
        clim = load_stats(cfg.time_means_path, C, "time means")
        if clim.shape[2] < H or clim.shape[3] < W:
            raise DataError(f"time means {cfg.time_means_path} are {clim.shape[2]}x"
                            f"{clim.shape[3]}, smaller than img_size {H}x{W}")
        self.time_mean = np.ascontiguousarray(clim[0, :, :H, :W])  # physical units
        clim = torch.from_numpy(clim[:, :, :H, :W]).to(device)
        self.climatology = (clim - self.means) / self.stds  # normalised, for ACC
        self.regions, self.weights = weights_tensor(self.grid, device)

    def channel(self, c: int) -> tuple[float, float]:
        """(mean, std) of channel `c`, to turn a normalised field back into units."""
        return self.means[0, c].item(), self.stds[0, c].item()


@torch.no_grad()
def validate(model: torch.nn.Module, loss_fn: torch.nn.Module, loader: Any, layout: Layout,
             precision: Precision, norm: Normaliser, max_batches: int | None = None,
             members: Members | None = None) -> dict[str, Any]:
    """The run's loss (`loss_fn`, in eval mode: `crps` scores the fair CRPS there, not the
    training one, networks/loss.py), latitude-weighted RMSE(u10m) in m/s
    (WeatherBench-2's: the root of the mean over samples of the global weighted MSE, as
    inference.py reports it), persistence RMSE
    and ACC (anomalies against the time mean) over the validation set, summed over the
    data-parallel ranks and averaged. On a spatial mesh the loader and the model hold this
    rank's tile of every field (the layout's), and the scores are those of the whole grid
    (collectives over "h-w": every rank of the mesh calls this).

    An ensemble (`members`, this rank's): each sample's members forecast with validation
    noise keyed by the sample's index in the data set (the same at every validation and on
    any layout); RMSE and ACC are the ensemble mean's, and `spread_u10m` is the ensemble's
    spread (WeatherBench-2's: the root of the mean variance over members, unbiased), to be
    read against the ensemble mean's RMSE (spread/skill: evaluation/ensemble_scores.py)."""
    model.eval()
    loss_fn.eval()
    tile, device = layout.tile, layout.device
    climatology = norm.climatology[..., tile.rows, tile.cols]
    weights = norm.weights[0]  # global
    # [loss x samples, mse_u10, persistence mse_u10, acc_u10, acc_t2m, variance_u10], summed
    # over samples
    sums = torch.zeros(6, dtype=torch.float64, device=device)
    samples, first = 0, None
    var_u10 = norm.stds[0, U10, 0, 0].double() ** 2
    u10, both = slice(U10, U10 + 1), [U10, T2M]
    for i, (inp, tar) in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        inp, tar = inp.to(device, non_blocking=True), tar.to(device, non_blocking=True)
        if members is None:
            with precision.autocast():
                gen = model(inp)
            gen = gen.float()
            loss, variance = loss_fn(gen, tar), gen.new_zeros(())
        else:
            noise = members.noise(VALIDATION, 0, members.samples(samples, inp.shape[0]), 1,
                                  device)
            with precision.autocast():
                mine = rollout(model, inp, 1, noise)[:, 0]  # (B, M, C, H, W) fp32
            loss = loss_fn(mine, tar)
            gen = ensemble_mean(mine, members.size)
            spread = ensemble_variance(mine[:, :, u10], gen[:, u10], members.size)
            variance = weighted_mean_channels(spread, weights, tile).sum()
        mse = weighted_mse_channels(gen[:, u10], tar[:, u10], weights, tile)
        persist = weighted_mse_channels(inp[:, u10], tar[:, u10], weights, tile)
        skill = weighted_acc_channels(gen[:, both], tar[:, both], climatology[:, both],
                                      weights, tile)
        sums += torch.stack([loss * inp.shape[0], mse.sum(), persist.sum(), skill[:, 0].sum(),
                             skill[:, 1].sum(), variance]).double()
        samples += inp.shape[0]
        if first is None:  # t2m of the first sample: input, target, forecast, whole grid
            maps = whole_field(torch.stack([inp[0, T2M], tar[0, T2M], gen[0, T2M]]), tile)
            first = tuple(m.cpu().numpy() for m in maps)
    totals = comm.sum_over(torch.cat([sums, sums.new_tensor([samples])]), "dp")
    n = max(totals[6].item(), 1.0)
    rmse = torch.sqrt(totals[[1, 2, 5]] / n * var_u10).tolist()
    model.train()
    loss_fn.train()
    out = {"loss": totals[0].item() / n, "rmse_u10m": rmse[0],
           "persistence_rmse_u10m": rmse[1], "acc_u10m": totals[3].item() / n,
           "acc_t2m": totals[4].item() / n, "samples": n, "example_t2m": first}
    if members is not None:
        out["spread_u10m"], out["members"] = rmse[2], members.size
    return out


def ensemble_mean(mine: torch.Tensor, size: int) -> torch.Tensor:
    """This rank's members (B, M, ...) of an ensemble of `size` -> the mean of all its
    members (B, ...): a sum over the members, completed over the ens ranks (collective over
    "ens" where they split the members)."""
    return comm.sum_over(mine.sum(dim=1), "ens") / size


def ensemble_variance(mine: torch.Tensor, mean: torch.Tensor, size: int) -> torch.Tensor:
    """The unbiased variance over all `size` members (B, ...) of an ensemble whose mean is
    `mean`, from this rank's members `mine` (B, M, ...) (collective over "ens", as
    `ensemble_mean`)."""
    return comm.sum_over((mine - mean.unsqueeze(1)).square().sum(dim=1), "ens") / (size - 1)
