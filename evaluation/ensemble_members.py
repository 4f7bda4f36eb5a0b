"""Where an evaluated ensemble's members come from: the model's own noise, perturbed
initial conditions, or the planet itself (the perfect-model reference).

`inference.py --ensemble_size E` forecasts E members from every initial condition:

  - an ensemble checkpoint (trained with ensemble_size > 1, networks/noise.py): every member
    starts from the initial condition and rolls out with its own noise, fresh at every step,
    drawn as training draws it (networks/ensemble.py) from the FORECAST stream, keyed by
    (the run's seed, the initial time in hours since 1970, member, step): the same members
    on any layout and batching. E may differ from the training's ensemble_size: a member is
    the network with other noise;
  - a deterministic checkpoint: the members start from perturbed initial conditions,
    x0 + sigma * N(0, 1) at every grid point and channel (normalised units: sigma times
    each channel's std), drawn on the whole grid, keyed by (seed, initial time, member),
    and roll out without noise. Every member is perturbed (none is the unperturbed
    "control"), so the members are exchangeable, as the fair CRPS assumes.

The perfect-model ensemble (`PerfectEnsemble`) of a synthetic planet made with forcing
(data/perfect_ensemble.py): the planet branched at each initial condition into E members
with forcing draws of their own, normalised and cropped as the forecasts are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import h5py
import numpy as np
import torch

from data.forecast import InitialCondition, RolloutData
from data.perfect_ensemble import perfect_ensemble
from networks.ensemble import FORECAST, Members, member_inputs
from utils.tile import Tile

# The perturbations' own keys within the FORECAST stream (the noise's are 5 long).
_PERTURBATION = 1


@dataclasses.dataclass(frozen=True)
class EnsembleForecast:
    """E members of every initial condition: from the model's noise (`members`, an ensemble
    checkpoint) or from initial conditions perturbed by `perturbation` (a deterministic
    one); `seed` the run's, `tile` this rank's part of the grid."""

    size: int
    members: Members | None
    perturbation: float
    seed: int
    tile: Tile

    @classmethod
    def of(cls, size: int, members: Members | None, perturbation: float, seed: int,
           tile: Tile) -> EnsembleForecast:
        """`members`: the checkpoint's own (Layout.members), None for a deterministic model;
        re-sized to `size` members, all on this rank."""
        if members is not None:
            members = dataclasses.replace(members, size=size, first=0, count=size)
        return cls(size, members, perturbation, seed, tile)

    def describe(self) -> str:
        """One log line: where the members come from."""
        if self.members is not None:
            return (f"Ensemble of {self.size}: the checkpoint's noise-conditioned members, "
                    f"fresh noise every step (seed {self.seed}, keyed by initial time)")
        return (f"Ensemble of {self.size} from a deterministic checkpoint: members start from "
                f"perturbed initial conditions, x0 + {self.perturbation:g} x N(0, 1) per grid "
                f"point and channel (normalised units; seed {self.seed}, keyed by initial "
                f"time and member)")

    def start(self, x0: torch.Tensor, keys: Sequence[int]) -> torch.Tensor:
        """(B, C, H, W) initial conditions -> (B E, C, H, W) members' starts (sample-major)."""
        x = member_inputs(x0, self.size)
        if self.members is not None:
            return x.clone()
        eps = np.stack([self._eps(int(key), m, x0.shape[1]) for key in keys
                        for m in range(self.size)])
        return x + self.perturbation * torch.from_numpy(eps).to(x)

    def _eps(self, key: int, member: int, channels: int) -> np.ndarray:
        rng = np.random.default_rng(np.random.SeedSequence(
            self.seed, spawn_key=(FORECAST, _PERTURBATION, key, member)))
        whole = rng.standard_normal((channels, *self.tile.grid), dtype=np.float32)
        return whole[:, self.tile.rows, self.tile.cols]

    def noise(self, keys: Sequence[int], steps: int, device: torch.device | str
              ) -> torch.Tensor | None:
        """(steps, B, E, noise_channels, h, w): the members' noise of every rollout step;
        None for members of a deterministic model."""
        if self.members is None:
            return None
        return self.members.noise(FORECAST, 0, [int(k) for k in keys], steps, device)


class PerfectEnsemble:
    """The perfect-model ensemble of `data`'s test split, or `available` False (and `why`)
    when the data are no forced synthetic planet."""

    def __init__(self, data: RolloutData, size: int):
        self.data, self.size = data, size
        with h5py.File(data.files[0], "r") as f:
            self.available = "planet_state" in f
        self.why = "" if self.available else (
            f"{data.location} holds no planet_state (real data, or a synthetic planet without "
            "--forcing)")

    def members(self, ics: list[InitialCondition], lead_steps: int, tile: Tile,
                device: torch.device | str) -> torch.Tensor:
        """(B, E, L+1, C, rows, cols) normalised fields of the members branched at each
        initial condition, on this rank's tile."""
        H, W = self.data.img_size
        out = []
        for ic in ics:
            x = perfect_ensemble(ic.file, ic.index, self.size, lead_steps, self.data.dt)
            x = x[..., :H, :W][..., tile.rows, tile.cols]
            out.append((x - self.data.means) / self.data.stds)
        return torch.from_numpy(np.stack(out).astype(np.float32)).to(device)
