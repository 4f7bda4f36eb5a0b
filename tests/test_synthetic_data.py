"""Tests of the synthetic ERA5-like generator: layout contract, stats, determinism, realism and
learnability (persistence is non-trivial, skill decays, a linear model is not enough).

The data set under test is the one every other test trains on: conftest's `tiny_data`
(16 x 32, 24 samples per year, seed 0)."""

import copy
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import REPO, TINY_IMG_SIZE, TINY_SAMPLES_PER_YEAR, child_env

from data.era5_names import CHANNEL_NAMES
from data.planet import Planet
from data.synthetic import generate

YEAR = TINY_SAMPLES_PER_YEAR  # samples in one file: one continuous trajectory


def _read(path):
    with h5py.File(path, "r") as f:
        return f["fields"][:]


def _train(out):
    return np.concatenate([_read(p) for p in sorted((out / "train").glob("*.h5"))])


def test_layout_shapes_and_attributes(tiny_data):
    out = tiny_data
    expected = {"train": ["2016.h5", "2017.h5"], "valid": ["2018.h5"], "test": ["2019.h5"]}
    for split, names in expected.items():
        assert sorted(p.name for p in (out / split).iterdir()) == names
        for name in names:
            with h5py.File(out / split / name, "r") as f:
                ds = f["fields"]
                assert ds.shape == (YEAR, 20, *TINY_IMG_SIZE) and ds.dtype == np.float32
                assert ds.chunks == (1, 20, *TINY_IMG_SIZE)
                assert list(ds.attrs["channel_names"]) == list(CHANNEL_NAMES)
                assert ds.attrs["dt_hours"] == 6 and ds.attrs["seed"] == 0
                assert np.isfinite(ds[:]).all()
    assert len(CHANNEL_NAMES) == 20 and CHANNEL_NAMES[0] == "u10" and CHANNEL_NAMES[-1] == "tcwv"
    assert not list(out.rglob("*.tmp"))


def test_stats_match_numpy(tiny_data):
    out = tiny_data
    x = _train(out).astype(np.float64)
    means = np.load(out / "stats" / "global_means.npy")
    stds = np.load(out / "stats" / "global_stds.npy")
    clim = np.load(out / "stats" / "time_means.npy")
    assert means.shape == stds.shape == (1, 20, 1, 1) and clim.shape == (1, 20, *TINY_IMG_SIZE)
    assert means.dtype == stds.dtype == clim.dtype == np.float32
    np.testing.assert_allclose(means, x.mean(axis=(0, 2, 3), keepdims=True), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(stds, x.std(axis=(0, 2, 3), keepdims=True), rtol=1e-4)
    np.testing.assert_allclose(clim, x.mean(axis=0, keepdims=True), rtol=1e-5, atol=1e-4)
    assert (stds > 0).all()


def test_realistic_magnitudes(tiny_data):
    out = tiny_data
    x = np.concatenate([_train(out), _read(out / "valid" / "2018.h5")])
    mean = {c: float(x[:, i].mean()) for i, c in enumerate(CHANNEL_NAMES)}
    assert 4.8e4 <= mean["z500"] <= 6e4 and 260 <= mean["t2m"] <= 300
    assert 9e4 <= mean["sp"] <= 1.1e5 and 1.0e5 <= mean["msl"] <= 1.03e5
    assert mean["z1000"] < mean["z850"] < mean["z500"] < mean["z50"]
    assert mean["t2m"] > mean["t850"] > mean["t500"]
    for r in ("r500", "r850"):
        assert x[:, CHANNEL_NAMES.index(r)].min() >= 0 and x[:, CHANNEL_NAMES.index(r)].max() <= 100
    tcwv = x[:, CHANNEL_NAMES.index("tcwv")]
    assert tcwv.min() >= 0 and 5 < tcwv.mean() < 40
    t2m = x[:, CHANNEL_NAMES.index("t2m")].mean(axis=(0, 2))  # zonal mean, row 0 = north
    assert t2m[len(t2m) // 2] - min(t2m[0], t2m[-1]) > 20  # equator-to-pole contrast
    stds = x.std(axis=(0, 2, 3))
    assert stds.max() / stds.min() > 100  # channels differ wildly: normalisation matters


def test_persistence_is_nontrivial_and_skill_decays(tiny_data):
    out = tiny_data
    x = _train(out)[:YEAR].astype(np.float64)  # one year: a continuous trajectory
    means = np.load(out / "stats" / "global_means.npy")
    stds = np.load(out / "stats" / "global_stds.npy")
    u10 = ((x - means) / stds)[:, CHANNEL_NAMES.index("u10")]
    err = [np.sqrt(np.mean((u10[lead:] - u10[:-lead]) ** 2)) for lead in (1, 2, 4)]
    assert 0.05 < err[0] < 1.0
    assert err[0] < err[1] < err[2]


def test_linear_predictor_is_not_enough(tiny_data):
    out = tiny_data
    x = _train(out).astype(np.float64)
    means = np.load(out / "stats" / "global_means.npy")
    xn = (x - means) / np.load(out / "stats" / "global_stds.npy")
    c = CHANNEL_NAMES.index("u10")
    # One global linear map from the 3x3 neighbourhood of all 20 channels (inside a year).
    rows, targets = [], []
    for year in (xn[:YEAR], xn[YEAR:]):
        nb = [np.roll(year[:-1], (dy, dx), axis=(2, 3)) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
        rows.append(np.concatenate(nb, axis=1).transpose(0, 2, 3, 1).reshape(-1, 180))
        targets.append(year[1:, c].reshape(-1))
    a = np.concatenate(rows)
    a = np.concatenate([a, np.ones((len(a), 1))], axis=1)
    y = np.concatenate(targets)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    linear = np.sqrt(np.mean((a @ coef - y) ** 2))
    persistence = np.sqrt(np.mean((a[:, 4 * 20 + c] - y) ** 2))  # centre pixel, channel u10
    assert linear < persistence  # in-sample: persistence is one of the linear maps
    assert linear > 0.3 * persistence  # but far from perfect: the dynamics are nonlinear


def test_nearby_states_diverge():
    """Chaos: a tiny perturbation of a turbulent state grows by a large factor in 16 days."""
    planet = Planet(32, 64, seed=0, samples_per_year=64)
    for _ in range(120):
        planet.advance()
    twin = copy.deepcopy(planet)
    twin.state[:2] *= 1.0 + 1e-4 * np.random.default_rng(1).standard_normal(twin.state[:2].shape)

    def distance():
        p, t = planet.streamfunctions(planet.state)[0], twin.streamfunctions(twin.state)[0]
        return np.abs(p - t).sum() / np.abs(p).sum()

    start = distance()
    for _ in range(64):
        planet.advance()
        twin.advance()
    assert distance() > 5 * start


def test_deterministic_and_seed_dependent(tmp_path, monkeypatch):
    monkeypatch.setattr("data.planet._SPINUP_DAYS", 2.0)  # bytes, not physics, are under test here
    kw = dict(img_size=(8, 16), samples_per_year=4)
    runs = [generate(tmp_path / name, seed=s, **kw) for name, s in (("a", 0), ("b", 0), ("c", 1))]
    files = [Path(f).relative_to(tmp_path / "a") for f in runs[0]["files"]]
    assert len(files) == 10  # 4 years, 3 stats, climatology, latitude and longitude
    for rel in files:
        a, b, c = ((tmp_path / d / rel).read_bytes() for d in "abc")
        assert a == b, f"{rel} differs between two runs with the same seed"
        if rel.name not in ("latitude.npy", "longitude.npy"):  # the grid is the grid
            assert a != c, f"{rel} identical for different seeds"


def test_idempotent_and_force(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("data.planet._SPINUP_DAYS", 1.0)
    kw = dict(img_size=(8, 16), samples_per_year=2)
    generate(tmp_path, **kw)
    stamp = (tmp_path / "stats" / "time_means.npy").stat().st_mtime_ns
    assert generate(tmp_path, **kw)["skipped"]
    assert "complete" in capsys.readouterr().out
    assert (tmp_path / "stats" / "time_means.npy").stat().st_mtime_ns == stamp
    assert not generate(tmp_path, force=True, **kw)["skipped"]
    with pytest.raises(ValueError, match="different"):
        generate(tmp_path, img_size=(8, 16), samples_per_year=3)
    with pytest.raises(ValueError, match="samples_per_year"):
        generate(tmp_path / "bad", img_size=(8, 16), samples_per_year=0)


@pytest.mark.e2e
def test_cli(tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "data.synthetic", "--out", str(out), "--img_size", "8",
           "16", "--samples_per_year", "2", "--valid_years", "1", "--seed", "3"]
    env = child_env()
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert (out / "stats" / "time_means.npy").exists() and (out / "test" / "2019.h5").exists()
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "complete" in again.stdout
    bad = subprocess.run(cmd[:5] + ["0", "16"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--img_size" in bad.stderr
