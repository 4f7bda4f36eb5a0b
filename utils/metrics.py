"""Latitude-weighted RMSE and anomaly correlation (ACC), per channel.

Rows run from +90 (north) to -90 degrees; a row's weight is cos(latitude) normalised to
mean 1, so polar rows (which cover little area) count little.
"""

import torch


def latitudes(num_lat: int) -> torch.Tensor:
    """Latitude in degrees of each row, +90 .. -90."""
    return torch.linspace(90.0, -90.0, num_lat, dtype=torch.float64)


def latitude_weights(num_lat: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(num_lat, 1) weights, cos(lat) / mean(cos(lat))."""
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
