"""The synthetic planet's stochastic forcing (data/synthetic.py, `--forcing`): the same seed
gives the same bytes, forcing 0 is the deterministic planet, the kick has the z500 amplitude
it is given.

Small grids (8 x 16 and 16 x 32 outputs: the dynamics' smallest core, 32 x 64) and spin-ups
shortened to a few days: the bytes and the statistics of the forcing are under test here, not
the planet's climate."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

import data.synthetic as sd
from data.era5_names import CHANNEL_NAMES
from data.synthetic import generate

Z500 = CHANNEL_NAMES.index("z500")


def _fields(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["fields"][:]


def test_forcing_is_deterministic_per_seed_and_forcing_0_is_the_deterministic_planet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sd, "_SPINUP_DAYS", 2.0)
    kw = dict(img_size=(8, 16), samples_per_year=4)
    runs = {name: generate(tmp_path / name, **kw, **extra) for name, extra in (
        ("a", {"forcing": 50.0}), ("b", {"forcing": 50.0}), ("zero", {"forcing": 0.0}),
        ("plain", {}))}
    for rel in (Path(f).relative_to(tmp_path / "a") for f in runs["a"]["files"]):
        a, b, zero, plain = ((tmp_path / d / rel).read_bytes() for d in runs)
        assert a == b, f"{rel} differs between two forced runs with the same seed"
        assert zero == plain, f"{rel}: forcing 0 is not the deterministic planet"
        if rel.suffix == ".h5":
            assert a != zero, f"{rel} identical with and without forcing"
    with h5py.File(tmp_path / "a" / "test" / "2019.h5", "r") as f:
        assert f["fields"].attrs["forcing"] == 50.0 and "planet_state" in f
    with h5py.File(tmp_path / "a" / "train" / "2016.h5", "r") as f:
        assert "planet_state" not in f  # only the test years keep their states
    with h5py.File(tmp_path / "zero" / "test" / "2019.h5", "r") as f:
        assert "forcing" not in f["fields"].attrs and "planet_state" not in f
    with pytest.raises(ValueError, match="different"):  # forced data over unforced
        generate(tmp_path / "zero", **kw, forcing=50.0)
    with pytest.raises(ValueError, match="forcing must be >= 0"):
        generate(tmp_path / "bad", **kw, forcing=-1.0)


def test_the_kick_has_the_z500_amplitude_it_is_given() -> None:
    """z500 is linear in the streamfunction: the change a kick makes to it, over 40 draws of
    2,048 points each, has the root mean square asked for, within 5 %."""
    planet = sd.Planet(32, 64, seed=0, samples_per_year=16, forcing=80.0)
    land, orog = sd.orography((32, 64))
    before = planet.diagnose((32, 64), land, orog)[Z500].astype(np.float64)
    squares = []
    for k in range(40):
        kicked = planet.branch(k)
        kicked.state = kicked.state.copy()
        kicked.state[:2] += kicked.kick() * kicked.mask
        after = kicked.diagnose((32, 64), land, orog)[Z500].astype(np.float64)
        squares.append(np.mean((after - before) ** 2))
    assert np.sqrt(np.mean(squares)) == pytest.approx(80.0, rel=0.05)
