"""What a rollout is scored against besides the truth, in the units the scores work in.

The channels scored are the data's (normalised with the global means and stds) and, when
there is a climatology of it, the derived 10 m wind speed `ws10` that WeatherBench-2
reports, in m/s (scale 1). References:

  - the climatology at each valid time, the anomaly reference of ACC and the "climatology"
    baseline: the data set's harmonic fit (stats/climatology.npz, data/climatology.py, at
    the sample's year fraction and hour of day), or WeatherBench-2's own climatology store
    (`store`: evaluation/wb2_climatology.py, at the valid time's day of year and hour);
  - the time mean (time_means.npy), the "time_mean" baseline.

A data set without climatology.npz (and no store) falls back to the time mean for both
(logged once).
Everything lives on this rank's tile of the grid (spatial parallelism) and on its device.

Relative humidity has two definitions (data/humidity.py): a climatology of one is no
reference for data of the other. The data's (its year files' `rh_definition`), the harmonic
climatology's and the store's (WeatherBench-2's own, unless it records another) must
agree, or the evaluation stops with one line; a side that records none is not checked.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from data.climatology import basis, load_climatology
from data.era5_names import WIND_COMPONENTS, WIND_SPEED, channel
from data.humidity import DEFINITIONS
from evaluation.scores import Normaliser
from evaluation.wb2_climatology import StoreClimatology
from utils.config_schema import Config
from utils.errors import DataError
from utils.tile import Tile

log = logging.getLogger(__name__)


class References:
    """Scoring units, channels and references of a config's data (module docstring)."""

    def __init__(self, cfg: Config, norm: Normaliser, channels: list[str], tile: Tile,
                 store: str | None = None, rh_definition: str = ""):
        device = norm.means.device
        rows, cols = tile.rows, tile.cols
        self._tile = tile
        C = len(channels)
        # With a store, only the harmonic climatology's time mean (ws10's) is needed.
        clim = load_climatology(os.path.dirname(cfg.time_means_path), cfg.img_size,
                                coefficients=store is None)
        humidity = [c for c in channels
                    if (info := channel(c)) is not None and info.variable == "relative_humidity"]
        if clim is not None:
            same_humidity(humidity, rh_definition, "the data's test split",
                          clim.rh_definition, clim.path)
        derive = ((store is not None or (clim is not None and WIND_SPEED.name in clim.channels))
                  and all(c in channels for c in WIND_COMPONENTS))
        self.channels = [*channels, WIND_SPEED.name] if derive else list(channels)
        self._wind = [channels.index(c) for c in WIND_COMPONENTS] if derive else []
        scale = torch.ones(len(self.channels), dtype=torch.float64, device=device)
        offset = torch.zeros_like(scale)
        scale[:C], offset[:C] = norm.stds.flatten().double(), norm.means.flatten().double()
        self.scale, self.offset = scale, offset  # physical = scored * scale + offset
        self._mean_c = norm.means.flatten()
        self._std_c = norm.stds.flatten()
        time_mean = torch.from_numpy(norm.time_mean[:, rows, cols]).to(device)
        self._store = None
        if store is not None:
            self.kind = f"WeatherBench-2 climatology store {store} (day of year x hour)"
            self._store = StoreClimatology(store, self.channels, norm.grid)
            same_humidity(humidity, rh_definition, "the data's test split",
                          self._store.rh_definition, f"the climatology store {store}")
            self._coefficients = None
            self.time_mean = self._with_wind(time_mean, clim, rows, cols)
            return
        if clim is None:
            log.warning(f"{os.path.dirname(cfg.time_means_path)} has no climatology.npz: "
                        "ACC and the climatology baseline use time_means (prepare the data "
                        "again for the seasonal and diurnal climatology)")
            self.kind = "time mean"
            self._coefficients = None
            self.time_mean = self._scored(time_mean)[None, None]
            return
        self.kind = "seasonal and diurnal harmonics"
        pick = [clim.channels.index(c) for c in self.channels]
        mean = torch.from_numpy(clim.time_mean[pick][:, rows, cols]).to(device).double()
        coefficients = clim.coefficients
        if pick != list(range(len(pick))):  # else no copy: 1.2 GB at 0.25 degrees
            coefficients = coefficients[:, pick]
        coef = torch.from_numpy(np.ascontiguousarray(coefficients[:, :, rows, cols]))
        del clim, coefficients
        coef = coef.to(device)
        coef /= self.scale.float()[None, :, None, None]
        coef[0] -= (self.offset / self.scale).float()[:, None, None]  # the constant term
        self._coefficients = coef  # (T, C', rows, cols): the climatology in scored units
        self.time_mean = ((mean - self.offset[:, None, None]) / self.scale[:, None, None]
                          ).float()[None, None]

    def _with_wind(self, time_mean: torch.Tensor, clim, rows, cols) -> torch.Tensor:
        """The time-mean baseline (1, 1, C', rows, cols) in scored units: time_means.npy,
        and for ws10 the mean wind speed of climatology.npz (NaN without one: no score
        rather than a wrong one)."""
        mean = self._scored(time_mean)
        if len(self.channels) > len(mean):
            extra = torch.full_like(mean[:1], float("nan"))
            if clim is not None and WIND_SPEED.name in clim.channels:
                speed = clim.time_mean[clim.channels.index(WIND_SPEED.name)][rows, cols]
                extra = torch.from_numpy(speed).to(mean)[None]
            mean = torch.cat([mean, extra])
        return mean[None, None]

    def _scored(self, physical: torch.Tensor) -> torch.Tensor:
        """(C, ...) physical fields of the data's channels -> normalised."""
        shape = (-1,) + (1,) * (physical.dim() - 1)
        return (physical - self._mean_c.view(shape)) / self._std_c.view(shape)

    def extend(self, x: torch.Tensor) -> torch.Tensor:
        """(..., C, H, W) normalised fields -> (..., C', H, W) with the derived channels."""
        if not self._wind:
            return x
        u, v = (x[..., c, :, :] * self._std_c[c] + self._mean_c[c] for c in self._wind)
        return torch.cat([x, torch.hypot(u, v).unsqueeze(-3)], dim=-3)

    def plan(self, hours: np.ndarray) -> None:
        """The valid times (hours since 1970) this rank will ask `climatology` for: a
        WeatherBench-2 store then reads each of its chunks once."""
        if self._store is not None:
            self._store.plan(hours)

    def climatology(self, phase: np.ndarray, hour: np.ndarray,
                    hours: np.ndarray | None = None) -> torch.Tensor:
        """(..., C', H, W) climatology at each valid time (year fraction `phase` and UTC
        `hour`, each (...); for a WeatherBench-2 store, `hours` since 1970-01-01), or the
        time mean, (1, 1, C', H, W), when the data has no climatology."""
        if self._store is not None:
            fields = self._store.at(hours)[..., self._tile.rows, self._tile.cols]
            x = torch.from_numpy(np.ascontiguousarray(fields)).to(self.scale.device)
            shape = (-1, 1, 1)
            x -= self.offset.float().view(shape)
            x /= self.scale.float().view(shape)
            return x
        if self._coefficients is None:
            return self.time_mean
        b = torch.from_numpy(basis(phase, hour)).to(self._coefficients)
        return torch.einsum("...t,tchw->...chw", b, self._coefficients)

    def physical(self, x: torch.Tensor) -> torch.Tensor:
        """(..., C, H, W) scored fields of the first C channels -> physical units, float32
        (a float64 copy of a batch's forecasts at 0.25 degrees would be GBs)."""
        C = x.shape[-3]
        scale, offset = (t[:C].float().view(-1, 1, 1) for t in (self.scale, self.offset))
        return x.float() * scale + offset


def same_humidity(channels: list[str], ours: str, ours_where: str, theirs: str,
                  theirs_where: str) -> None:
    """A DataError if relative humidity channels would be compared across definitions."""
    if channels and ours in DEFINITIONS and theirs in DEFINITIONS and ours != theirs:
        raise DataError(f"{', '.join(channels)}: {ours_where} holds {DEFINITIONS[ours]} "
                        f"relative humidity, {theirs_where} {DEFINITIONS[theirs]}; one is no "
                        f"reference for the other: prepare the data with --rh_definition "
                        f"{theirs} (or score against a climatology of {ours})")
