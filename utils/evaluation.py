"""How a forecast is scored: the training loss, latitude-weighted RMSE and anomaly
correlation (ACC) per channel, and `validate` over a data-parallel validation set.

Rows run from +90 (north) to -90 degrees; a row's weight is cos(latitude) normalised to
mean 1, so polar rows (which cover little area) count little.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from utils import comm
from utils.data.loader import load_stats, load_stds
from utils.errors import DataError
from utils.precision import autocast


def l2_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The tutorial's training loss: mean_b ||pred_b - target_b||_2 / ||target_b||_2 over
    all channels and pixels. Computed in fp32 even under autocast: the norms sum ~10^5
    squares."""
    b = pred.shape[0]
    diff = (pred.float() - target.float()).reshape(b, -1)
    return (diff.norm(dim=1) / target.float().reshape(b, -1).norm(dim=1)).mean()


def latitudes(num_lat: int) -> torch.Tensor:
    """Latitude in degrees of each row, +90 .. -90."""
    return torch.linspace(90.0, -90.0, num_lat, dtype=torch.float64)


@functools.lru_cache(maxsize=16)
def latitude_weights(num_lat: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(num_lat, 1) weights, cos(lat) / mean(cos(lat)); made once per grid and device."""
    w = torch.cos(torch.deg2rad(latitudes(num_lat)))
    return (w / w.mean()).to(device=device, dtype=torch.float32).unsqueeze(1)


def weighted_rmse_channels(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, C): sqrt of the latitude-weighted mean squared error."""
    w = latitude_weights(pred.shape[-2], pred.device)
    return torch.sqrt(torch.mean(w * (pred.float() - target.float()) ** 2, dim=(-1, -2)))


def weighted_acc_channels(pred: torch.Tensor, target: torch.Tensor,
                          climatology: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, C): weighted correlation of anomalies w.r.t. the climatology."""
    w = latitude_weights(pred.shape[-2], pred.device)
    a_p = pred.float() - climatology
    a_t = target.float() - climatology
    num = torch.sum(w * a_p * a_t, dim=(-1, -2))
    den = torch.sqrt(torch.sum(w * a_p**2, dim=(-1, -2)) * torch.sum(w * a_t**2, dim=(-1, -2)))
    return num / den


class Normaliser:
    """Per-channel global statistics, to report errors in physical units, and the
    normalised climatology that ACC measures anomalies against."""

    def __init__(self, params: Any, device: torch.device):
        C = int(params.n_out_channels)
        H, W = params.img_size
        # load_stats: a missing file or a wrong shape is a one-line DataError.
        self.means = torch.from_numpy(
            load_stats(params.global_means_path, C, "global means")).to(device)
        self.stds = torch.from_numpy(load_stds(params.global_stds_path, C)).to(device)
        clim = load_stats(params.time_means_path, C, "time means")
        if clim.shape[2] < H or clim.shape[3] < W:
            raise DataError(f"time means {params.time_means_path} are {clim.shape[2]}x"
                            f"{clim.shape[3]}, smaller than img_size {H}x{W}")
        clim = torch.from_numpy(clim[:, :, :H, :W]).to(device)
        self.climatology = (clim - self.means) / self.stds  # normalised, for ACC

    def channel(self, c: int) -> tuple[float, float]:
        """(mean, std) of channel `c`, to turn a normalised field back into units."""
        return self.means[0, c].item(), self.stds[0, c].item()


@torch.no_grad()
def validate(model: torch.nn.Module, loader: Any, device: torch.device, params: Any,
             norm: Normaliser, max_batches: int | None = None) -> dict[str, Any]:
    """Loss, latitude-weighted RMSE(u10m) in m/s, persistence RMSE and ACC over the
    validation set, summed over the data-parallel ranks and averaged."""
    model.eval()
    # [loss x samples, rmse_u10, persistence_u10, acc_u10, acc_t2m], summed over samples
    sums = torch.zeros(5, dtype=torch.float64, device=device)
    samples, first = 0, None
    std = norm.stds[0, :, 0, 0]
    for i, (inp, tar) in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        inp, tar = inp.to(device, non_blocking=True), tar.to(device, non_blocking=True)
        with autocast(params, device):
            gen = model(inp)
        gen = gen.float()
        rmse = weighted_rmse_channels(gen, tar) * std
        persist = weighted_rmse_channels(inp, tar) * std
        skill = weighted_acc_channels(gen, tar, norm.climatology)
        sums += torch.stack([l2_loss(gen, tar) * inp.shape[0], rmse[:, 0].sum(),
                             persist[:, 0].sum(), skill[:, 0].sum(), skill[:, 2].sum()]).double()
        samples += inp.shape[0]
        if first is None:
            first = (inp[0, 2].cpu().numpy(), tar[0, 2].cpu().numpy(), gen[0, 2].cpu().numpy())
    totals = comm.sum_over(torch.cat([sums, sums.new_tensor([samples])]), "dp").tolist()
    n = max(totals[5], 1.0)
    model.train()
    return {"loss": totals[0] / n, "rmse_u10m": totals[1] / n,
            "persistence_rmse_u10m": totals[2] / n, "acc_u10m": totals[3] / n,
            "acc_t2m": totals[4] / n, "samples": n, "example_t2m": first}
