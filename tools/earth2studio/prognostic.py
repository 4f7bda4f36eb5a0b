"""A model of this project as an Earth2Studio prognostic model: its workflows (deterministic,
ensemble, diagnostic ...), data sources and IO backends run it like FourCastNet or SFNO.

    from tools.earth2studio.prognostic import Forecaster
    model = Forecaster.from_pretrained("exports/cpu_quickstart")   # a package directory
    x, coords = model(x, coords)                     # one step of 6 h
    for x, coords in model.create_iterator(x, coords): ...   # lead 0 first, then each step

Needs Earth2Studio (requirements-earth2studio.txt); nothing else of the project imports this
module. It implements Earth2Studio's prognostic-model interface as its own models do:
`input_coords()` (batch, lead_time [0 h], variable, lat, lon: the package's Earth2Studio
names and grid, north to south), `output_coords(input_coords)` (lead_time one step on,
checked against `input_coords`), `__call__(x, coords)` (one step), `create_iterator(x,
coords)` (the initial state, then step after step, with the front and rear hooks of
`PrognosticMixin`), `to(device)` (a torch module), and loading from a package
(`load_model(package)`, `from_pretrained(path)`; there is no default package).

The step is the project's inference step, in fp32: the fields are normalised with the
package's statistics, the network forecasts the next state, and the result is turned back
into physical units. Any dimensions before lead_time are a batch.

An ensemble model (trained with ensemble_size > 1, networks/noise.py) forecasts each member
with its own noise, drawn exactly as inference.py draws it (networks/ensemble.py: the
FORECAST stream, keyed by the run's seed, the initial time in hours since 1970, the member
and the rollout step), so Earth2Studio's `ensemble` coordinate names the same members as
`inference.py --save_forecasts` writes for `realization`. The key needs the initial time:
the coordinates must have a `time` dimension (Earth2Studio's workflows give one); without an
`ensemble` dimension the forecast is member 0's. Run it with `earth2studio.run.ensemble` and
the zero perturbation (`earth2studio.perturbation.Zero`): the members differ by their noise.
A deterministic model's members in that workflow come from a perturbation, e.g. ours
(`InitialConditionPerturbation`: inference.py's perturbed initial conditions).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import torch
from earth2studio.models.auto import AutoModelMixin, Package
from earth2studio.models.batch import batch_coords
from earth2studio.models.px.utils import PrognosticMixin
from earth2studio.utils import handshake_coords, handshake_dim
from earth2studio.utils.type import CoordSystem

from evaluation.ensemble_members import EnsembleForecast
from evaluation.inference_flags import IC_PERTURBATION
from networks.ensemble import FORECAST, Members
from tools.earth2studio.package import ModelPackage, read_package
from tools.earth2studio.source import hours_since_1970
from utils.tile import Tile

# The dimensions of a model's state after any batch dimensions (Earth2Studio's order).
STATE_DIMS = ("lead_time", "variable", "lat", "lon")


class Forecaster(torch.nn.Module, AutoModelMixin, PrognosticMixin):
    """The network of a package (tools/earth2studio/package.py), one step of its time step
    per call."""

    def __init__(self, package: ModelPackage):
        super().__init__()
        self.model = package.model()
        self.package = dataclasses.replace(package, weights={})  # the model holds them now
        self.register_buffer("center", torch.from_numpy(package.means).view(-1, 1, 1))
        self.register_buffer("scale", torch.from_numpy(package.stds).view(-1, 1, 1))
        self.step = np.timedelta64(package.step_hours, "h")
        cfg = package.config
        self.patch_grid = (cfg.img_size[0] // cfg.patch_size, cfg.img_size[1] // cfg.patch_size)

    def __str__(self) -> str:
        return f"{self.package.config.config} ({self.package.config.model})"

    # ------------------------------------------------------------------ loading
    @classmethod
    def load_default_package(cls) -> Package:
        raise NotImplementedError(
            "this project publishes no package: export one with python -m "
            "tools.export_earth2studio, then Forecaster.from_pretrained(<its directory>)")

    @classmethod
    def load_model(cls, package: Package) -> Forecaster:
        """The model of an Earth2Studio Package (a directory, or any fsspec location)."""
        return cls(read_package(package.resolve))

    # ------------------------------------------------------------------ coordinates
    def input_coords(self) -> CoordSystem:
        return OrderedDict({
            "batch": np.empty(0),
            "lead_time": np.array([np.timedelta64(0, "h")]),
            "variable": np.array(self.package.variables),
            "lat": self.package.latitude.copy(),
            "lon": self.package.longitude.copy(),
        })

    @batch_coords()
    def output_coords(self, input_coords: CoordSystem) -> CoordSystem:
        """`input_coords` one step later; a ValueError or KeyError (Earth2Studio's
        handshakes) if they are not this model's."""
        target = self.input_coords()
        test = input_coords.copy()
        test["lead_time"] = test["lead_time"] - input_coords["lead_time"][-1]
        for i, key in enumerate(target):
            if key != "batch":
                handshake_dim(test, key, i)
                handshake_coords(test, target, key)
        out = target.copy()
        out["batch"] = input_coords["batch"]
        out["lead_time"] = input_coords["lead_time"] + self.step
        return out

    # ------------------------------------------------------------------ forecasting
    def __call__(self, x: torch.Tensor, coords: CoordSystem
                 ) -> tuple[torch.Tensor, CoordSystem]:
        """One step: the state (..., 1, C, H, W) at `coords` -> the state a step later."""
        out_coords = self.output_coords(coords)
        return self._physical(self._step(self._normalised(x), coords), x.shape), out_coords

    def create_iterator(self, x: torch.Tensor, coords: CoordSystem
                        ) -> Iterator[tuple[torch.Tensor, CoordSystem]]:
        """The initial state, then one step after another, for ever. The state carried from
        step to step is the normalised one, as inference.py carries it (rounding it to
        physical units and back at every step would add float32 rounding of the field's
        value, not of its anomaly, that a rollout amplifies); a hook that changes the state
        is honoured: the next step normalises what it returns."""
        coords = coords.copy()
        self.output_coords(coords)  # checks the coordinates before the first yield
        yield x, coords
        z = self._normalised(x)
        while True:
            hooked, coords = self.front_hook(x, coords)
            z = z if hooked is x else self._normalised(hooked)
            z, coords = self._step(z, coords), self.output_coords(coords)
            x = self._physical(z, hooked.shape)
            hooked, coords = self.rear_hook(x, coords)
            z = z if hooked is x else self._normalised(hooked)
            x = hooked
            yield x, coords.copy()

    @torch.inference_mode()
    def _normalised(self, x: torch.Tensor) -> torch.Tensor:
        """(..., 1, C, H, W) physical -> (N, C, H, W) normalised states."""
        return (x.reshape(-1, *x.shape[-3:]) - self.center) / self.scale

    @torch.inference_mode()
    def _physical(self, z: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return (z * self.scale + self.center).reshape(shape)

    @torch.inference_mode()
    def _step(self, z: torch.Tensor, coords: CoordSystem) -> torch.Tensor:
        """One step of the network from the normalised states `z` at `coords`, in fp32."""
        if self.package.ensemble_size > 1:
            return self.model(z, self._noise(coords, z.shape[0])).float()
        return self.model(z).float()

    def _noise(self, coords: CoordSystem, n: int) -> torch.Tensor:
        """(n, noise_channels, h, w): the noise of each of the n states' member for this
        step, keyed as inference.py keys it (module docstring)."""
        keys, members = self._member_keys(coords, n)
        step = int(coords["lead_time"][-1] // self.step)
        cfg = self.package.config
        size = int(members.max()) + 1
        drawn = Members(size=size, first=0, count=size, noise_channels=cfg.noise_channels,
                        grid=self.patch_grid, rows=slice(0, self.patch_grid[0]),
                        cols=slice(0, self.patch_grid[1]), seed=cfg.seed)
        unique, which = np.unique(keys, return_inverse=True)
        # Each step has a key of its own: the draws of steps 0 .. step, keep the last.
        noise = drawn.noise(FORECAST, 0, unique.tolist(), step + 1, self.center.device)[step]
        return noise[torch.as_tensor(which), torch.as_tensor(members)]

    def _member_keys(self, coords: CoordSystem, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(initial time in hours since 1970, member) of each of the n states, from the
        coordinates before lead_time (`time` required, `ensemble` optional: member 0)."""
        leading = [k for k in coords if k not in STATE_DIMS]
        if "time" not in leading:
            raise ValueError(
                f"an ensemble member's noise is keyed by its initial time: the coordinates "
                f"({', '.join(coords)}) need a 'time' dimension before lead_time")
        grids = np.meshgrid(*(np.arange(len(coords[k])) for k in leading), indexing="ij")
        place = {k: g.reshape(-1) for k, g in zip(leading, grids, strict=True)}
        keys = hours_since_1970(np.asarray(coords["time"])[place["time"]])
        members = (np.asarray(coords["ensemble"], dtype=np.int64)[place["ensemble"]]
                   if "ensemble" in place else np.zeros(n, dtype=np.int64))
        if len(keys) != n:
            raise ValueError(f"{n} states and coordinates of {len(keys)}")
        return keys, members


class InitialConditionPerturbation:
    """Earth2Studio `Perturbation`: inference.py's members of a deterministic model, x0 +
    sigma x std x N(0, 1) at every grid point and channel (sigma in normalised units,
    evaluation/ensemble_members.py), keyed by the seed, the initial time and the member, so
    `earth2studio.run.ensemble` starts the members inference.py starts."""

    def __init__(self, forecaster: Forecaster, sigma: float = IC_PERTURBATION):
        self.forecaster, self.sigma = forecaster, sigma

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor, coords: CoordSystem
                 ) -> tuple[torch.Tensor, CoordSystem]:
        f = self.forecaster
        keys, members = f._member_keys(coords, int(np.prod(x.shape[:-4])))
        size = int(members.max()) + 1
        grid = tuple(f.package.config.img_size)
        members_of = EnsembleForecast(size, None, self.sigma, f.package.config.seed,
                                      Tile.whole(grid))
        state = x.reshape(-1, *x.shape[-3:])
        out = torch.empty_like(state)
        for i, (key, member) in enumerate(zip(keys, members, strict=True)):
            z = (state[i:i + 1] - f.center) / f.scale
            z = members_of.start(z, [int(key)])[member]  # that key's members, in order
            out[i] = z * f.scale + f.center
        return out.reshape(x.shape), coords
