"""inference.py end to end: a checkpoint of train.py / train_mp.py, rolled out and scored.

The scores inference.py writes are checked against an independent computation: the test
reads the initial conditions straight from the HDF5 file with h5py, normalises them with
numpy, steps the checkpoint's serial model one sample at a time, evaluates the seasonal
climatology's harmonics at each valid time with its own formula, and scores with plain
Python loops and WeatherBench-2's weights of the file's latitudes (helpers'
`reference_scores`). fp32 model and batch order differ (batches of 2 vs 1 here), so they
agree to rtol 1e-4 (measured ~1e-6). The forecasts written with --save_forecasts are read
back with xarray and scored again.

A train_mp.py (tp = 2) checkpoint gives the same scores evaluated serially, with --tp 2,
--cp 2 and with 2 data-parallel ranks: rtol 1e-5 (measured <= 1e-6: sums split over ranks
and the model's matmuls split over tp change only the last bits).
"""

from __future__ import annotations

import json
import math

import h5py
import numpy as np
import pytest
import torch
from helpers import CONFIG_FILE, lat_weights, reference_scores, run_script

from networks.vit import vit_from_params
from training.checkpoint import latest_checkpoint
from utils.config import read_config

ITERS = 8
LEAD = 4
N_ICS = 5
CHECKED = ("u10", "t2m", "z500")
OUTPUTS = ("skill.csv", "skill.json", "skill_vs_lead.png", "rollout_t2m.png", "inference.log")
FORECASTS = ("model", "persistence", "climatology", "time_mean")
REGIONS = ["global", "northern-hemisphere", "tropics", "southern-hemisphere"]
TIMEOUT = 240


def train(script, tiny_data, tmp_path_factory, *flags, nproc=None):
    run = run_script(script, ["--config=tiny", f"--num_iters={ITERS}", *flags],
                     data_dir=tiny_data, log_dir=tmp_path_factory.mktemp("logs"), nproc=nproc,
                     timeout=TIMEOUT)
    assert run.returncode == 0, run.output[-3000:]
    return run


def evaluate(run, *flags, nproc=None, out=None):
    args = [f"--lead_steps={LEAD}", f"--n_initial_conditions={N_ICS}", "--batch_size=2",
            *flags] + ([f"--out={out}"] if out else [])
    result = run_script("inference.py", args, data_dir=run.data_dir, log_dir=run.log_dir,
                        nproc=nproc, timeout=TIMEOUT)
    assert result.returncode == 0, result.output[-3000:]
    return result


@pytest.fixture(scope="module")
def serial_run(tiny_data, tmp_path_factory):
    return train("train.py", tiny_data, tmp_path_factory)


@pytest.fixture(scope="module")
def evaluated(serial_run):
    """inference.py --config=tiny: finds the run under LOG_DIR, writes <run>/forecast/ and
    the forecasts (--save_forecasts)."""
    zarr = serial_run.exp_dir("tiny") / "forecasts.zarr"
    result = evaluate(serial_run, "--config=tiny", f"--save_forecasts={zarr}")
    out = serial_run.exp_dir("tiny") / "forecast"
    return result, out, json.loads((out / "skill.json").read_text())


def harmonics(phase: float, hour: float) -> np.ndarray:
    """The climatology's 14 terms (docs/scoring.md), written out again."""
    y, d = 2 * math.pi * phase, 2 * math.pi * hour / 24
    return np.array([1, math.cos(y), math.sin(y), math.cos(2 * y), math.sin(2 * y),
                     math.cos(3 * y), math.sin(3 * y), math.cos(d), math.sin(d),
                     math.cos(2 * d), math.cos(d) * math.cos(y), math.cos(d) * math.sin(y),
                     math.sin(d) * math.cos(y), math.sin(d) * math.sin(y)])


def independent_scores(skill_json, checkpoint, tiny_data):
    """Model, persistence and climatology scores of the JSON's initial conditions, computed
    without inference.py's code: (rmse, acc), each (3 forecasts, LEAD + 1, channels)."""
    params = read_config(CONFIG_FILE, "tiny", environ={"DATA_DIR": str(tiny_data)})
    H, W = params.img_size
    model = vit_from_params(params)
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
    model.eval()
    means = np.load(tiny_data / "stats" / "global_means.npy")[0].astype(np.float64)
    stds = np.load(tiny_data / "stats" / "global_stds.npy")[0].astype(np.float64)
    time_mean = np.load(tiny_data / "stats" / "time_means.npy")[0].astype(np.float64)
    coefficients = np.load(tiny_data / "stats" / "climatology.npz")["coefficients"][:, :20]
    truths, forecasts, climatologies = [], [], []
    for ic in skill_json["initial_conditions"]:
        with h5py.File(tiny_data / "test" / ic["file"], "r") as f:
            raw = f["fields"][ic["index"]: ic["index"] + LEAD + 1, :, :H, :W].astype(np.float64)
            hours = f["time"][ic["index"]: ic["index"] + LEAD + 1]
            latitudes = f["latitude"][:H]
            per_year = f["fields"].attrs["samples_per_year"]
        climatologies.append([np.tensordot(harmonics((ic["index"] + k) / per_year,
                                                     hours[k] % 24), coefficients, 1)
                              for k in range(LEAD + 1)])
        x = torch.from_numpy(((raw[0] - means) / stds).astype(np.float32))[None]
        steps = [raw[0]]
        with torch.no_grad():
            for _ in range(LEAD):
                x = model(x)
                steps.append(x[0].double().numpy() * stds + means)
        truths.append(raw)
        forecasts.append(np.stack(steps))
    channels = list(skill_json["channels"])
    pick = [channels.index(c) for c in CHECKED]
    truth, forecast = np.stack(truths)[:, :, pick], np.stack(forecasts)[:, :, pick]
    climatology = np.stack(climatologies)[:, :, pick].astype(np.float64)
    persistence = np.repeat(truth[:, :1], LEAD + 1, axis=1)
    mean = np.broadcast_to(time_mean[pick], truth.shape)
    scores = [reference_scores(p, truth, climatology, latitudes)
              for p in (forecast, persistence, climatology, mean)]
    return np.stack([s[0] for s in scores]), np.stack([s[1] for s in scores])


def from_json(skill_json, metric):
    """(4 forecasts, leads, CHECKED channels) from skill.json."""
    return np.stack([np.array([skill_json["channels"][c][metric][f] for c in CHECKED]).T
                     for f in FORECASTS])


@pytest.mark.e2e
def test_inference_writes_every_output_and_the_table(evaluated):
    result, out, skill = evaluated
    for name in OUTPUTS:
        assert (out / name).is_file(), name
    for forecast in FORECASTS:
        assert list((out / "tensorboard" / forecast).glob("events.out.tfevents.*")), forecast
    assert skill["config"] == "tiny" and skill["iteration"] == ITERS
    assert skill["lead_hours"] == [6 * k for k in range(LEAD + 1)]
    assert len(skill["channels"]) == 21 and skill["n_initial_conditions"] == N_ICS
    assert list(skill["channels"])[-1] == "ws10" and skill["regions"] == REGIONS
    assert skill["climatology"] == "seasonal and diurnal harmonics"
    rows = (out / "skill.csv").read_text().splitlines()
    assert len(rows) == 1 + len(REGIONS) * 21 * (LEAD + 1)
    for name in ("z500", "t850", "t2m", "u10", "v10", "ws10", "msl"):  # WB2's headline
        assert f"| {name} lead | RMSE model |" in result.stdout
        assert f"{name}: model RMSE above persistence" in result.stdout
    assert "Forecast skill of z500 (geopotential 500 hPa)" in result.stdout


@pytest.mark.e2e
def test_scores_agree_with_an_independent_computation(evaluated, serial_run, tiny_data):
    _, _, skill = evaluated
    checkpoint = latest_checkpoint(str(serial_run.exp_dir("tiny")))
    rmse, acc = independent_scores(skill, checkpoint, tiny_data)
    np.testing.assert_allclose(from_json(skill, "rmse"), rmse, rtol=1e-4)
    np.testing.assert_allclose(from_json(skill, "acc"), acc, rtol=1e-4, atol=1e-6)


@pytest.mark.e2e
def test_at_lead_0_model_and_persistence_are_the_truth(evaluated):
    _, _, skill = evaluated
    for name, channel in skill["channels"].items():
        for region, scores in channel["regions"].items():
            where = f"{name} {region}"
            assert scores["rmse"]["model"][0] == 0.0 == scores["rmse"]["persistence"][0], where
            assert scores["acc"]["model"][0] == pytest.approx(1.0, abs=1e-5), where
            assert scores["rmse"]["climatology"][0] > 0, where
            assert scores["acc"]["climatology"] == [0.0] * (LEAD + 1), where


@pytest.mark.e2e
def test_saved_forecasts_are_weatherbench2s_layout_and_score_the_same(evaluated, serial_run,
                                                                       tiny_data):
    """xarray reads --save_forecasts' store; z500 at 12 h, scored from it with numpy against
    the HDF5 truth and the files' own latitude weights, is skill.json's RMSE."""
    import xarray as xr

    _, _, skill = evaluated
    ds = xr.open_zarr(serial_run.exp_dir("tiny") / "forecasts.zarr")
    assert set(ds.dims) == {"time", "prediction_timedelta", "level", "latitude", "longitude"}
    assert ds["geopotential"].dims == ("time", "prediction_timedelta", "level", "latitude",
                                       "longitude")
    assert ds["2m_temperature"].attrs["units"] == "K" and list(ds.level.values) == [50, 500,
                                                                                   850, 1000]
    assert (np.diff(ds.latitude.values) > 0).all()
    assert list(ds.prediction_timedelta.values.astype("timedelta64[h]").astype(int)) == \
        [6 * k for k in range(LEAD + 1)]
    with h5py.File(tiny_data / "test" / "2019.h5", "r") as f:
        hours, fields = f["time"][:], f["fields"]
        starts = [ic["index"] for ic in skill["initial_conditions"]]
        expected = np.datetime64("1970-01-01T00", "h") + hours[starts].astype("timedelta64[h]")
        np.testing.assert_array_equal(ds.time.values.astype("datetime64[h]"), expected)
        truth = np.stack([fields[i + 2, 14] for i in starts]).astype(np.float64)  # z500, +12 h
        latitudes = f["latitude"][:]
    z500 = ds["geopotential"].sel(level=500, prediction_timedelta=np.timedelta64(12, "h"))
    forecast = z500.sortby("latitude", ascending=False).values.astype(np.float64)
    weights = np.array(lat_weights(list(latitudes)))[None, :, None]
    rmse = np.sqrt(np.mean(np.mean(weights * (forecast - truth) ** 2, axis=(1, 2))))
    assert rmse == pytest.approx(skill["channels"]["z500"]["rmse"]["model"][2], rel=1e-5)
    assert np.isnan(ds["temperature"].sel(level=1000).values).all()  # no t1000 channel


@pytest.fixture(scope="module")
def tp2_run(tiny_data, tmp_path_factory):
    return train("train_mp.py", tiny_data, tmp_path_factory, "--tp=2", nproc=2)


@pytest.fixture(scope="module")
def tp2_serial(tp2_run, tmp_path_factory):
    """The tp = 2 checkpoint evaluated on one process, with the config saved in the run."""
    out = tmp_path_factory.mktemp("serial")
    evaluate(tp2_run, f"--run_dir={tp2_run.exp_dir('tiny', world_size=2)}", out=out)
    return json.loads((out / "skill.json").read_text())


@pytest.mark.e2e
@pytest.mark.distributed
@pytest.mark.parametrize("layout", [["--tp=2"], ["--cp=2"], []], ids=["tp2", "cp2", "dp2"])
def test_a_tp2_checkpoint_scores_the_same_serially_and_in_parallel(tp2_run, tp2_serial,
                                                                   layout, tmp_path):
    run_dir = tp2_run.exp_dir("tiny", world_size=2)
    evaluate(tp2_run, f"--run_dir={run_dir}", *layout, nproc=2, out=tmp_path)
    parallel, serial = json.loads((tmp_path / "skill.json").read_text()), tp2_serial
    tp, cp = (2 if f"--{g}=2" in layout else 1 for g in ("tp", "cp"))
    assert serial["layout"] == {"tp": 1, "cp": 1, "h": 1, "w": 1, "ens": 1, "dp": 1}
    assert parallel["layout"] == {"tp": tp, "cp": cp, "h": 1, "w": 1, "ens": 1,
                                  "dp": 2 // (tp * cp)}
    assert parallel["initial_conditions"] == serial["initial_conditions"]
    for name in serial["channels"]:
        for metric in ("rmse", "acc"):
            for forecast in FORECASTS:
                np.testing.assert_allclose(parallel["channels"][name][metric][forecast],
                                           serial["channels"][name][metric][forecast],
                                           rtol=1e-5, atol=1e-7, err_msg=f"{name} {metric}")


@pytest.mark.e2e
def test_a_user_error_ends_the_script_with_one_line_and_exit_code_2(serial_run, tmp_path):
    result = run_script("inference.py", [f"--checkpoint={tmp_path}/ckpt.pt"],
                        data_dir=serial_run.data_dir, log_dir=serial_run.log_dir,
                        timeout=TIMEOUT)
    assert result.returncode == 2, result.output[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"error: checkpoint {tmp_path}/ckpt.pt not found"]


@pytest.mark.e2e
@pytest.mark.distributed
def test_a_missing_run_dir_is_one_line_per_torchrun_job(tiny_data, tmp_path):
    """The README's step-12 mistake: a run directory that does not exist, under torchrun.
    One line (not one per rank), saying that the directory, not a checkpoint, is missing."""
    missing = tmp_path / "logs" / "cpu_mp" / "2CPU" / "00"
    result = run_script("inference.py", [f"--run_dir={missing}", "--tp=2"], data_dir=tiny_data,
                        log_dir=tmp_path / "logs", nproc=2, timeout=TIMEOUT)
    assert result.returncode == 1, result.output[-3000:]  # torchrun: a worker failed
    errors = [line for line in result.output.splitlines() if "error:" in line]
    assert errors == [f"error: no run directory {missing} (--run_dir)"], result.output[-3000:]


@pytest.mark.e2e
@pytest.mark.distributed
def test_an_afno_scores_and_saves_the_same_on_a_spatial_mesh(tiny_data, tmp_path_factory):
    """h = 2: each rank rolls out and scores its tile of rows, with those rows' weights of
    every region; the sums over the mesh and the gathered forecasts are the serial ones."""
    import xarray as xr

    run = train("train.py", tiny_data, tmp_path_factory, "--config=tiny_afno")
    run_dir = run.exp_dir("tiny_afno")
    outs = {}
    for name, flags, nproc in (("serial", [], None), ("mesh", ["--h_parallel_size=2"], 2)):
        out = tmp_path_factory.mktemp(name)
        evaluate(run, f"--run_dir={run_dir}", f"--save_forecasts={out / 'f.zarr'}", *flags,
                 nproc=nproc, out=out)
        outs[name] = out
    serial, mesh = (json.loads((outs[n] / "skill.json").read_text()) for n in outs)
    assert mesh["layout"]["h"] == 2 and mesh["regions"] == serial["regions"] == REGIONS
    for name in serial["channels"]:
        for region in REGIONS:
            for metric in ("rmse", "acc"):
                for forecast in FORECASTS:
                    np.testing.assert_allclose(
                        mesh["channels"][name]["regions"][region][metric][forecast],
                        serial["channels"][name]["regions"][region][metric][forecast],
                        rtol=1e-5, atol=1e-6, err_msg=f"{name} {region} {metric} {forecast}")
    a, b = (xr.open_zarr(outs[n] / "f.zarr") for n in ("serial", "mesh"))
    np.testing.assert_allclose(b["geopotential"].values, a["geopotential"].values, rtol=1e-5,
                               equal_nan=True)
