"""From a WeatherBench-2-layout Zarr store to scores and forecasts, as a user runs it:
prepare_era5 on the command line (parallel workers, then SLURM-style array tasks), train.py
for a few iterations on the prepared data, inference.py with regional scores, the seasonal
climatology, --save_forecasts and --save_truth (the two stores pass WeatherBench-2's rule and
give skill.csv's numbers again), and with --climatology (WeatherBench-2's climatology
store as ACC's reference and the climatology baseline).

The store is made here (tests/era5_stores.py): three years (2016, a leap year, to 2018),
6-hourly, the first 12 days of each, on an 11.25 degree grid with both poles (17 x 32)
that --crop_rows 16 turns into the tiny config's 16 x 32 (as the tutorial's 720 of ERA5's
721 rows).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from era5_stores import clim_known, grid, wb2_climatology, wb2_rule, wb2_zarr
from helpers import REPO, child_env, lat_weights, run_script

YEARS = ["--train_years", "2016", "--valid_years", "2017", "--test_years", "2018"]
REGIONS = ["global", "northern-hemisphere", "tropics", "southern-hemisphere"]
TIMEOUT = 300


def prepare(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "era5.prepare", *args]
    return subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return wb2_zarr(tmp_path_factory.mktemp("wb2") / "era5.zarr", [2016, 2017, 2018],
                    rows=17, cols=32, days=12)


@pytest.fixture(scope="module")
def prepared(store, tmp_path_factory):
    out = tmp_path_factory.mktemp("era5")
    run = prepare(str(store), str(out), *YEARS, "--crop_rows", "16", "--max_samples", "48",
                  "--workers", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    return out, run


@pytest.mark.e2e
def test_prepared_with_workers_progress_and_a_summary(prepared):
    out, run = prepared
    last = [line for line in run.stderr.splitlines() if line.startswith("prepared")][-1]
    assert "100%" in last and "144/144" in last and "samples/s" in last  # tqdm, a line each
    assert "MB/s written" in last
    assert "wrote 3 year file(s), 144 samples" in run.stdout and "peak memory" in run.stdout
    for split, year in (("train", 2016), ("valid", 2017), ("test", 2018)):
        assert (out / split / f"{year}.h5").is_file()
    lat = np.load(out / "stats" / "latitude.npy")
    np.testing.assert_allclose(lat, 90 - 11.25 * np.arange(16))


@pytest.mark.e2e
def test_array_tasks_then_a_merge_make_the_same_files(store, prepared, tmp_path):
    out, _ = prepared
    flags = (str(store), str(tmp_path), *YEARS, "--crop_rows", "16", "--max_samples", "48")
    for task in range(3):
        run = prepare(*flags, "--task", str(task))
        assert run.returncode == 0 and "statistics" not in run.stdout, run.stderr[-2000:]
    assert not (tmp_path / "stats" / "global_means.npy").exists()
    run = prepare(*flags)
    assert run.returncode == 0 and run.stderr.count("is complete, skipped") == 3
    for name in ("global_means.npy", "global_stds.npy", "time_means.npy", "climatology.npz"):
        assert (tmp_path / "stats" / name).read_bytes() == (out / "stats" / name).read_bytes()
    bad = prepare(*flags, "--task", "3")
    assert bad.returncode == 2 and bad.stderr.strip() == \
        "error: --task 3: there are 3 years (0 .. 2)"


@pytest.mark.e2e
@pytest.mark.parametrize("command", ["data.prepare_era5", "utils.data.prepare_era5"])
def test_the_older_commands_run_the_preparation(tmp_path, command):
    run = subprocess.run([sys.executable, "-m", command, str(tmp_path / "x"),
                          str(tmp_path / "out"), "--train_years", "2016"], cwd=REPO,
                         env=child_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 2 and run.stderr.strip() == \
        f"error: source {tmp_path / 'x'} does not exist"


@pytest.fixture(scope="module")
def evaluated(prepared, tmp_path_factory):
    out, _ = prepared
    logs = tmp_path_factory.mktemp("logs")
    train = run_script("train.py", ["--config=tiny", "--num_iters=4"], data_dir=out,
                       log_dir=logs, timeout=TIMEOUT)
    assert train.returncode == 0, train.output[-3000:]
    zarr = logs / "forecasts.zarr"
    result = run_script("inference.py", ["--config=tiny", "--lead_steps=4",
                                         "--n_initial_conditions=5", "--init_hours=0,12",
                                         f"--save_forecasts={zarr}",
                                         f"--save_truth={logs / 'truth.zarr'}"],
                        data_dir=out, log_dir=logs, timeout=TIMEOUT)
    assert result.returncode == 0, result.output[-3000:]
    forecast = train.exp_dir("tiny") / "forecast"
    return result, forecast, zarr


@pytest.mark.e2e
def test_trained_and_scored_by_region_against_the_seasonal_climatology(evaluated):
    result, forecast, _ = evaluated
    skill = json.loads((forecast / "skill.json").read_text())
    assert skill["regions"] == REGIONS
    assert skill["climatology"] == "seasonal and diurnal harmonics"
    assert skill["channels"]["z500"]["variable"] == "geopotential"
    for region in REGIONS:
        scores = skill["channels"]["t2m"]["regions"][region]
        assert all(np.isfinite(scores["rmse"]["climatology"])), region
        assert scores["acc"]["climatology"] == [0.0] * 5, region
    rows = (forecast / "skill.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert header[:2] == ["region", "channel"] and "rmse_climatology" in header
    assert {r.split(",")[0] for r in rows[1:]} == set(REGIONS)
    assert len(rows) == 1 + 4 * 21 * 5
    assert "climatology: seasonal and diurnal harmonics" in result.stdout
    assert "latitude 90.00 to -78.75" in result.stdout
    assert ("5 initial conditions from" in result.stdout and "(5 on this rank, 8 at a time: "
            "chosen for the 16 x 32 grid) at 0, 12 UTC" in result.stdout)


@pytest.mark.e2e
def test_forecasts_are_readable_by_xarray_with_the_right_coordinates(evaluated, prepared):
    import xarray as xr

    _, _, zarr = evaluated
    out, _ = prepared
    ds = xr.open_zarr(zarr)
    assert ds.time.values[0] == np.datetime64("2018-01-01T00", "ns")
    assert ds.sizes["time"] == 5 and list(ds.level.values) == [50, 500, 850, 1000]
    assert set(ds.time.dt.hour.values) == {0, 12}  # --init_hours 0,12
    assert ds["relative_humidity"].attrs["rh_definition"] == "wb2"  # the store's own
    np.testing.assert_allclose(ds.latitude.values, np.load(out / "stats" / "latitude.npy")[::-1])
    np.testing.assert_allclose(ds.longitude.values, 11.25 * np.arange(32))
    assert ds["geopotential"].attrs["units"] == "m**2 s**-2"
    humidity = ds["relative_humidity"].sel(level=500, prediction_timedelta=np.timedelta64(0, "h"))
    assert humidity.attrs["units"] == "1" and 0 < float(humidity.mean()) < 1  # as WB2's
    lead = ds["2m_temperature"].sel(prediction_timedelta=np.timedelta64(0, "h")).values
    assert np.isfinite(lead).all() and 100 < float(np.mean(lead)) < 1000


def _skill_csv(path, column: str) -> dict[tuple[str, str, int], float]:
    rows = [r.split(",") for r in path.read_text().splitlines()]
    k = rows[0].index(column)
    return {(r[0], r[1], int(r[5])): float(r[k]) for r in rows[1:]}


@pytest.mark.e2e
def test_the_forecast_and_truth_stores_pass_weatherbench2s_rule_and_give_our_scores(
        evaluated):
    """--crop_rows 16 made a grid the public store does not have: against the truth store
    --save_truth wrote, WeatherBench-2's rule holds, and its MSE (its latitude weights, the
    mean over initial times) is skill.csv's RMSE squared, at every lead."""
    import xarray as xr

    result, forecast_dir, zarr = evaluated
    forecast, truth = wb2_rule(xr.open_zarr(zarr), xr.open_zarr(zarr.parent / "truth.zarr"))
    valid = np.unique(forecast.time.values[:, None] + forecast.prediction_timedelta.values)
    np.testing.assert_array_equal(truth.time.values, valid)  # every valid time, no other
    assert f"Wrote the truth at {len(valid)} valid times" in result.stdout
    weights = np.array(lat_weights(list(truth.latitude.values)))[:, None]
    rmse = _skill_csv(forecast_dir / "skill.csv", "rmse_model")
    for k, lead in enumerate(forecast.prediction_timedelta.values):
        f = forecast["geopotential"].sel(level=500).isel(prediction_timedelta=k)
        t = truth["geopotential"].sel(level=500, time=f.time + lead)
        mse = (weights * (f.values - t.values) ** 2).mean(axis=(1, 2)).mean()
        assert np.sqrt(mse) == pytest.approx(rmse[("global", "z500", k)], rel=1e-4), k


@pytest.fixture(scope="module")
def with_wb2_climatology(prepared, evaluated, tmp_path_factory):
    """inference.py --climatology on a store in WeatherBench-2's layout on the source's
    17-row grid (the data is its first 16 rows)."""
    out, _ = prepared
    lat, lon = grid(17, 32)
    store = wb2_climatology(tmp_path_factory.mktemp("clim") / "clim.zarr", lat, lon)
    logs = evaluated[2].parent  # LOG_DIR of the trained run
    result = run_script("inference.py", ["--config=tiny", "--lead_steps=4",
                                         "--n_initial_conditions=5", "--batch_size=5",
                                         "--init_hours=0,12", f"--climatology={store}",
                                         f"--out={logs / 'with_clim'}"],
                        data_dir=out, log_dir=logs, timeout=TIMEOUT)
    assert result.returncode == 0, result.output[-3000:]
    return result, logs / "with_clim"


@pytest.mark.e2e
def test_weatherbench2s_climatology_store_is_the_climatology_baseline(with_wb2_climatology,
                                                                       evaluated):
    """The climatology baseline's RMSE is that of the store's entries at each valid time's
    day of year and hour against the truth store; ACC is measured against them."""
    import xarray as xr

    result, out = with_wb2_climatology
    skill = json.loads((out / "skill.json").read_text())
    assert skill["climatology"].startswith("WeatherBench-2 climatology store")
    assert "(day of year x hour)" in result.stdout
    truth = xr.open_zarr(evaluated[2].parent / "truth.zarr").sortby("latitude", ascending=False)
    lat, lon = truth.latitude.values, truth.longitude.values
    weights = np.array(lat_weights(list(lat)))[:, None]
    initial = xr.open_zarr(evaluated[2]).time.values  # the same initial times
    rmse = _skill_csv(out / "skill.csv", "rmse_climatology")
    for k in range(5):
        valid = initial + np.timedelta64(6 * k, "h")
        day = (valid.astype("datetime64[D]") - valid.astype("datetime64[Y]")).astype(int) + 1
        hour = (valid.astype("datetime64[h]").astype(int) % 24)
        clim = clim_known("t2m", day, hour, lat, lon).astype(np.float64)
        t = truth["2m_temperature"].sel(time=valid).values
        mse = (weights * (clim - t) ** 2).mean(axis=(1, 2)).mean()
        assert np.sqrt(mse) == pytest.approx(rmse[("global", "t2m", k)], rel=1e-4), k
    acc = skill["channels"]["t2m"]["acc"]["model"]
    assert all(np.isfinite(acc)) and acc != json.loads(
        (evaluated[1] / "skill.json").read_text())["channels"]["t2m"]["acc"]["model"]
