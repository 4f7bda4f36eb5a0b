"""The synthetic planet's stochastic forcing (data/planet.py, `--forcing`) and its
perfect-model ensemble (data/perfect_ensemble.py): the same seed gives the same bytes, forcing
0 is the deterministic planet, the kick has the z500 amplitude it is given, branched members
start from the data's sample and spread out with lead, and against the data's own trajectory
(one more draw of the same process) the perfect ensemble's corrected spread/skill is 1.

Small grids (8 x 16 and 16 x 32 outputs: the dynamics' smallest core, 32 x 64) and spin-ups
shortened to a few days: the bytes and the statistics of the forcing are under test here, not
the planet's climate."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from data.era5_names import CHANNEL_NAMES
from data.perfect_ensemble import perfect_ensemble, planet_at
from data.planet import Planet, grid_of, orography
from data.synthetic import generate
from evaluation.ensemble_scores import ensemble_sums
from evaluation.regions import region_weights
from utils.errors import DataError

Z500 = CHANNEL_NAMES.index("z500")


@pytest.fixture(scope="module")
def forced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 x 32, 16 samples per year (1 + 1 + 1 years), forcing 100 m2/s2, 5-day spin-up."""
    out = tmp_path_factory.mktemp("forced")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("data.planet._SPINUP_DAYS", 5.0)
        generate(out, img_size=(16, 32), samples_per_year=16, train_years=1, valid_years=1,
                 test_years=1, forcing=100.0)
    return out


def _fields(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["fields"][:]


def test_forcing_is_deterministic_per_seed_and_forcing_0_is_the_deterministic_planet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("data.planet._SPINUP_DAYS", 2.0)
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
    planet = Planet(32, 64, seed=0, samples_per_year=16, forcing=80.0)
    land, orog = orography((32, 64))
    before = planet.diagnose((32, 64), land, orog)[Z500].astype(np.float64)
    squares = []
    for k in range(40):
        kicked = planet.branch(k)
        kicked.state = kicked.state.copy()
        kicked.state[:2] += kicked.kick() * kicked.mask
        after = kicked.diagnose((32, 64), land, orog)[Z500].astype(np.float64)
        squares.append(np.mean((after - before) ** 2))
    assert np.sqrt(np.mean(squares)) == pytest.approx(80.0, rel=0.05)


def test_branched_members_start_from_the_sample_and_spread_out_with_lead(forced: Path) -> None:
    path = forced / "test" / "2018.h5"
    data = _fields(path)
    members = perfect_ensemble(path, index=2, members=4, lead_steps=6)
    assert members.shape == (4, 7, 20, 16, 32) and members.dtype == np.float32
    for m in range(4):  # lead 0: the file's sample itself, bitwise
        assert np.array_equal(members[m, 0], data[2])
    spread = members.std(axis=0).mean(axis=(-2, -1))[:, Z500]  # (L+1,)
    assert spread[0] == 0 and spread[1] > 0
    assert spread[1] < spread[2] < spread[4] < spread[6], spread
    assert np.array_equal(perfect_ensemble(path, 2, 2, 2), members[:2, :3])  # same bytes
    assert not np.array_equal(perfect_ensemble(path, 2, 2, 2, ensemble_seed=1),
                              members[:2, :3])
    # The stored state with the data's own draws continues the file's trajectory, bitwise.
    planet, shape = planet_at(path, 2)
    land, orog = orography(shape)
    for k in (3, 4, 5):
        planet.advance()
        assert np.array_equal(planet.diagnose(shape, land, orog), data[k])


def test_the_perfect_ensembles_corrected_spread_skill_against_the_data_is_1(
        forced: Path) -> None:
    """4 members from each of 7 initial conditions, leads 6 and 12 h, against the data's own
    trajectory, every channel normalised: spread sqrt((E+1)/E) / ensemble-mean RMSE pooled
    over channels and leads is 1 within 0.06 (six ensemble seeds read 0.98-1.03); the plain
    ratio, sqrt(E/(E+1)) = 0.894 for a perfect ensemble, is outside."""
    path, E, L = forced / "test" / "2018.h5", 4, 2
    means = np.load(forced / "stats" / "global_means.npy")[0]
    stds = np.load(forced / "stats" / "global_stds.npy")[0]
    data = (_fields(path) - means) / stds
    starts = range(0, 14, 2)
    members = np.stack([(perfect_ensemble(path, i, E, L) - means) / stds for i in starts])
    truth = np.stack([data[i:i + L + 1] for i in starts])
    weights = torch.from_numpy(region_weights(grid_of(16, 32))[1][:1]).float()
    sums = ensemble_sums(torch.from_numpy(members[:, :, 1:]), torch.from_numpy(truth[:, 1:]),
                         weights)[:, 0]  # (4 sums, L, C)
    ratio = np.sqrt(sums[3].mean().item() / sums[2].mean().item())
    assert ratio * np.sqrt((E + 1) / E) == pytest.approx(1.0, abs=0.06)


def test_data_without_forcing_has_no_perfect_ensemble_in_one_line(tiny_data: Path) -> None:
    path = next((tiny_data / "test").glob("*.h5"))
    with pytest.raises(DataError, match="--forcing > 0") as err:
        perfect_ensemble(path, 0, 2, 1)
    assert "\n" not in str(err.value)
