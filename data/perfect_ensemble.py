"""The perfect-model reference ensemble of a synthetic data set made with stochastic forcing
(data/synthetic.py, `--forcing`): at a sample of a test year, the planet's stored state is
branched into E members that continue with forcing draws of their own. They have the right
dynamics and the right initial state, and only the future's kicks are unknown to them: their
spread is the one a perfect forecaster of this planet would have, and since the data's own
trajectory is one more draw of the same process, their corrected spread/skill against it is 1
(evaluation/ensemble_scores.py).

    members = perfect_ensemble("datasets/synthetic_ens/test/2019.h5", index=10, members=4,
                               lead_steps=20)
    # (E, L+1, 20, H, W) float32 in physical units; members[:, 0] is sample 10 itself

Lead k is k * dt samples after the initial one (dt as the config's). Member m of the
ensemble `ensemble_seed` branched at a sample draws its kicks from its own stream
(`Planet.branch`): the same arguments give the same bytes, another seed another ensemble.
The fields are those of the file's grid in physical units: crop and normalise them as the
forecasts' (data.forecast.RolloutData.read: (x - mean) / std over the first H rows and W
columns). The members run on the CPU: about E x L x dt steps of the generator.
"""

from __future__ import annotations

import os

import h5py
import numpy as np

from data.era5_names import CHANNEL_NAMES
from data.planet import Planet, orography
from utils.errors import DataError


def planet_at(path: str | os.PathLike, index: int) -> tuple[Planet, tuple[int, int]]:
    """The planet as it was at sample `index` of the year file `path` (the state that
    sample was diagnosed from), and the file's (H, W) grid."""
    with h5py.File(path, "r") as f:
        ds = f["fields"]
        if "planet_state" not in f:
            raise DataError(f"{path} holds no planet_state: the perfect-model ensemble "
                            "branches the test years of synthetic data made with --forcing > 0")
        if not 0 <= index < ds.shape[0]:
            raise DataError(f"{path} has samples 0..{ds.shape[0] - 1}, not {index}")
        attrs = dict(ds.attrs)
        ny, nx = (int(n) for n in f["planet_state"].attrs["grid"])
        state = f["planet_state"][index]
        shape = (int(ds.shape[2]), int(ds.shape[3]))
    planet = Planet(ny, nx, int(attrs["seed"]), int(attrs["samples_per_year"]),
                    float(attrs["forcing"]))
    planet.state = state
    planet.index = int(attrs["first_sample_index"]) + index
    return planet, shape


def perfect_ensemble(path: str | os.PathLike, index: int, members: int, lead_steps: int,
                     dt: int = 1, ensemble_seed: int = 0) -> np.ndarray:
    """(E, L+1, 20, H, W) float32, physical units: `members` branches of the planet at
    sample `index` of `path`, at leads 0, dt, ..., lead_steps * dt samples (module
    docstring)."""
    if members < 1 or lead_steps < 0 or dt < 1 or ensemble_seed < 0:
        raise ValueError(f"members >= 1, lead_steps >= 0, dt >= 1 and ensemble_seed >= 0 "
                         f"expected, got {members}, {lead_steps}, {dt}, {ensemble_seed}")
    planet, shape = planet_at(path, index)
    land, orog = orography(shape)
    out = np.empty((members, lead_steps + 1, len(CHANNEL_NAMES), *shape), dtype=np.float32)
    for m in range(members):
        member = planet.branch(m, ensemble_seed)
        out[m, 0] = member.diagnose(shape, land, orog)
        for k in range(1, lead_steps + 1):
            for _ in range(dt):
                member.advance()
            out[m, k] = member.diagnose(shape, land, orog)
    return out
