"""The Earth2Studio export without Earth2Studio (tools/earth2studio): the package a checkpoint
of any layout becomes (weights, statistics, channels, grid, step, ensemble) forecasts as the
checkpoint does; channels and grids Earth2Studio cannot name are refused in one line before
anything is written; a split of the data is a data source that serves the files' fields by
time. Its runs in Earth2Studio itself: tests/earth2studio (`make test-earth2studio`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from helpers import REPO, child_env, layout_of

from data.era5_names import CHANNEL_NAMES
from networks.factory import build_model
from tools.earth2studio.names import EARTH2STUDIO_NAMES, check_grid, earth2studio_variables
from tools.earth2studio.package import FILES, export, read_package
from tools.earth2studio.source import SplitSource, hours_since_1970
from training.checkpoint import Checkpointer, read_checkpoint
from training.progress import Progress
from training.run import build_optimizer, build_scheduler
from utils.errors import ConfigError, DataError
from utils.precision import Precision


def save_checkpoint(cfg, exp_dir) -> str:
    """ckpt_00000000.pt of the untrained model of `cfg`, as `Checkpointer` writes it."""
    model = build_model(cfg)
    optimizer = build_optimizer(cfg, model)
    return Checkpointer(str(exp_dir), cfg, model, optimizer, build_scheduler(cfg, optimizer),
                        Precision("none").grad_scaler(), layout_of(cfg)).save(Progress())


@pytest.fixture
def tiny_checkpoint(tiny_params, tiny_data, tmp_path, monkeypatch):
    """A tiny ViT's checkpoint saved as a tp 2 run saves it (full tensors), DATA_DIR set."""
    monkeypatch.setenv("DATA_DIR", str(tiny_data))
    return save_checkpoint(tiny_params.replace(tp=2), tmp_path / "run")


def test_the_twenty_channels_have_earth2studio_names_and_others_are_refused_in_one_line():
    names = earth2studio_variables(list(CHANNEL_NAMES), "here")
    assert names[:3] == ["u10m", "v10m", "t2m"] and names[14] == "z500" and len(set(names)) == 20
    assert set(EARTH2STUDIO_NAMES) - set(CHANNEL_NAMES) == {
        "u100m", "v100m", "u250", "v250", "z250", "t250"}  # FourCastNet's other six
    with pytest.raises(ConfigError, match=r"^here: channel q700 has no Earth2Studio name \(1 of "
                                          r"2 channels without one"):
        earth2studio_variables(["u10", "q700"], "here")


@pytest.mark.parametrize("lat, lon, what", [
    (np.linspace(-90, 90, 4), np.arange(8) * 45.0, "latitude -90 .. 90"),
    (np.linspace(90, -90, 4), np.arange(8) * 45.0 - 180, "longitude -180 .. 135"),
    (np.linspace(90, -90, 4), np.arange(9) * 45.0, "longitude 0 .. 360"),
], ids=["south-to-north", "negative-longitudes", "360-included"])
def test_a_grid_earth2studio_cannot_name_is_refused_in_one_line(lat, lon, what):
    with pytest.raises(ConfigError, match=f"^there: {what}; Earth2Studio's grids run") as e:
        check_grid(lat, lon, "there")
    assert "\n" not in str(e.value)
    check_grid(np.linspace(90, -90, 4), np.arange(8) * 45.0, "fine")


def test_a_package_forecasts_as_its_checkpoint_of_a_model_parallel_run(
        tiny_checkpoint, tiny_params, tiny_data, tmp_path):
    out = tmp_path / "package"
    metadata = export(tiny_checkpoint, str(out))
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    package = read_package(str(out))
    assert package.channels == list(CHANNEL_NAMES) and package.variables[:2] == ["u10m", "v10m"]
    assert package.step_hours == 6 and package.ensemble_size == 1 and metadata["ensemble"] is None
    with h5py.File(tiny_data / "test" / sorted(p.name for p in (tiny_data / "test").iterdir())[0]
                   ) as f:
        np.testing.assert_array_equal(package.latitude, f["latitude"][()])
        np.testing.assert_array_equal(package.longitude, f["longitude"][()])
    np.testing.assert_array_equal(package.means.reshape(1, -1, 1, 1),
                                  np.load(tiny_data / "stats" / "global_means.npy"))
    saved = read_checkpoint(tiny_checkpoint, None)["model"]
    serial = build_model(tiny_params)
    serial.load_state_dict(saved)
    x = torch.randn(2, 20, *tiny_params.img_size)
    with torch.no_grad():
        torch.testing.assert_close(package.model()(x), serial.eval()(x), rtol=0, atol=0)
    assert package.config.tp == 2  # the run's config, as saved; the package runs serially


def test_an_ensemble_package_records_its_members_noise(tiny_data, tmp_path, monkeypatch):
    from utils.config import read_config

    monkeypatch.setenv("DATA_DIR", str(tiny_data))
    cfg = read_config(REPO / "config" / "ViT.yaml", "tiny_ens")
    checkpoint = save_checkpoint(cfg.replace(seed=7), tmp_path / "run")
    metadata = export(checkpoint, str(tmp_path / "package"))
    assert metadata["ensemble"] == {"size": 4, "seed": 7, "noise_channels": cfg.noise_channels}
    assert read_package(str(tmp_path / "package")).ensemble_size == 4


def test_a_channel_without_a_name_is_refused_before_anything_is_written(
        tiny_params, tiny_data, tmp_path, monkeypatch):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    for path in (data / "test").iterdir():
        with h5py.File(path, "r+") as f:
            names = list(CHANNEL_NAMES)
            names[17] = "q500"
            f["fields"].attrs["channel_names"] = names
    monkeypatch.setenv("DATA_DIR", str(data))
    checkpoint = save_checkpoint(tiny_params, tmp_path / "run")
    with pytest.raises(ConfigError, match="channel q500 has no Earth2Studio name"):
        export(checkpoint, str(tmp_path / "package"))
    assert not (tmp_path / "package").exists()


def test_a_directory_of_other_files_is_not_overwritten(tiny_checkpoint, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError, match="mine holds notes.txt .*: give an empty or new"):
        export(tiny_checkpoint, str(tmp_path / "mine"))
    export(tiny_checkpoint, str(tmp_path / "package"))
    export(tiny_checkpoint, str(tmp_path / "package"))  # a package is replaced


def test_a_split_serves_the_files_fields_by_time_under_earth2studio_names(tiny_data):
    source = SplitSource(str(tiny_data / "test"))
    times = source.times()[[3, 0]]
    da = source(times, ["z500", "u10m"])
    assert da.dims == ("time", "variable", "lat", "lon") and list(da["variable"]) == ["z500",
                                                                                     "u10m"]
    path = sorted((tiny_data / "test").iterdir())[0]
    with h5py.File(path) as f:
        rows = [int(np.flatnonzero(f["time"][()] == h)[0]) for h in hours_since_1970(times)]
        expected = f["fields"][()][rows][:, [14, 0]]
        np.testing.assert_array_equal(da["lat"], f["latitude"][()])
    np.testing.assert_array_equal(da.values, expected)
    with pytest.raises(DataError, match="has no variable q500 "):
        source(times, ["q500"])
    with pytest.raises(DataError, match="has no sample at 1999-01-01T00"):
        source(np.datetime64("1999-01-01T00"), "z500")
    source.close()


@pytest.mark.e2e
def test_the_export_command_writes_a_package_or_one_error_line(tiny_checkpoint, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "tools.export_earth2studio", "--run_dir", str(run)]
    done = subprocess.run(cmd + [str(tmp_path / "pkg")], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"to {tmp_path / 'pkg'}: 20 variables (u10m, v10m," in done.stdout
    assert json.loads((tmp_path / "pkg" / "metadata.json").read_text())["step_hours"] == 6
    bad = subprocess.run([sys.executable, "-m", "tools.export_earth2studio", "--run_dir",
                          str(tmp_path / "nowhere"), str(tmp_path / "x")], cwd=REPO,
                         env=child_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith(f"error: no run directory "
                                                          f"{tmp_path / 'nowhere'}")
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
