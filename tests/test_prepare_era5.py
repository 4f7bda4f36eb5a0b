"""era5/prepare.py on ERA5 sources made here in the public layouts
(tests/era5_stores.py): WeatherBench-2 / ARCO-ERA5 Zarr stores and CDS NetCDF files, run
as a user runs it (its `main`, in this process; the CLI itself in the e2e tests).

Every value of a source is `known(channel, time, latitude, longitude)`, so each check says
exactly where a number must land: channel, row (north first), column and sample. The
statistics are compared with one numpy pass over the training years' prepared fields.
"""

from __future__ import annotations

import os
import re

import h5py
import numpy as np
import pytest
from era5_stores import arco_zarr, cds_netcdf, grid, known, wb2_zarr

from data.climatology import basis
from data.era5_names import CHANNEL_NAMES
from data.statistics import PartialSums
from era5 import prepare as era5_prepare
from utils.errors import DataError


def prepare(source, out, *flags: str) -> None:
    era5_prepare.main([str(source), str(out), *flags])


def read(path):
    with h5py.File(path, "r") as f:
        return (f["fields"][()], f["latitude"][()], f["longitude"][()], f["time"][()],
                dict(f["fields"].attrs))


def expected(hours, lat, lon) -> np.ndarray:
    """(T, 20, H, W) of the known fields."""
    return np.stack([known(name, hours, lat, lon) for name in CHANNEL_NAMES], axis=1)


HUMIDITY = [CHANNEL_NAMES.index(n) for n in ("r500", "r850")]
OTHERS = [c for c in range(len(CHANNEL_NAMES)) if c not in HUMIDITY]


def assert_known(fields, hours, lat, lon, humidity_rtol: float = 0.0) -> None:
    """Every channel is its known field: bit for bit, but relative humidity (in percent)
    within `humidity_rtol` where the source holds it otherwise (a fraction: x 100 rounds
    in float32; specific humidity: derived)."""
    want = expected(hours, lat, lon)
    np.testing.assert_array_equal(fields[:, OTHERS], want[:, OTHERS])
    np.testing.assert_allclose(fields[:, HUMIDITY], want[:, HUMIDITY], rtol=humidity_rtol,
                               atol=0)


@pytest.fixture(scope="module")
def arco(tmp_path_factory):
    """ARCO-ERA5 style: hourly, latitude 90 .. -90 (7 rows, both poles), 12 columns,
    specific humidity instead of relative humidity."""
    return arco_zarr(tmp_path_factory.mktemp("arco") / "era5.zarr", [2016, 2017], days=3)


@pytest.fixture(scope="module")
def prepared(arco, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    prepare(arco, out, "--train_years", "2016", "--test_years", "2017", "--max_samples", "9",
            "--crop_rows", "6", "--batch_size", "4")
    return out


def test_every_value_lands_in_its_channel_row_column_and_sample(prepared):
    fields, lat, lon, hours, attrs = read(prepared / "train" / "2016.h5")
    assert fields.shape == (9, 20, 6, 12) and fields.dtype == np.float32
    np.testing.assert_array_equal(lat, [90, 60, 30, 0, -30, -60])  # the south pole cropped
    np.testing.assert_array_equal(lon, np.arange(12) * 30.0)
    start = (np.datetime64("2016-01-01T00", "h") - np.datetime64("1970-01-01T00", "h"))
    np.testing.assert_array_equal(hours, start.astype(int) + 6 * np.arange(9))  # hourly -> 6 h
    assert_known(fields, hours, lat, lon, humidity_rtol=1e-5)  # derived from q, T and p
    assert fields[5, CHANNEL_NAMES.index("z500"), 2, 7] == known("z500", hours[5:6], [30.0],
                                                                 [210.0])[0, 0, 0]
    assert list(attrs["channel_names"]) == list(CHANNEL_NAMES) and attrs["dt_hours"] == 6
    assert attrs["samples_per_year"] == 1464  # 2016 is a leap year
    with h5py.File(prepared / "train" / "2016.h5", "r") as f:
        assert f["fields"].chunks == (1, 20, 6, 12)
    np.testing.assert_array_equal(np.load(prepared / "stats" / "latitude.npy"), lat)


def test_ascending_latitudes_without_poles_are_flipped_and_coarsened(tmp_path):
    """WeatherBench-2's coarse equiangular grids: ascending, no poles, longitude before
    latitude, 6-hourly."""
    source = wb2_zarr(tmp_path / "wb2.zarr", [2018], rows=6, cols=12, days=2, coarse=True)
    prepare(source, tmp_path / "out", "--train_years", "2018", "--coarsen", "2",
            "--max_samples", "8")
    fields, lat, lon, hours, _ = read(tmp_path / "out" / "train" / "2018.h5")
    assert fields.shape == (8, 20, 3, 6)
    src_lat, src_lon = grid(6, 12, ascending=True, poles=False)
    north_first = expected(hours, src_lat[::-1], src_lon)
    blocks = north_first.reshape(8, 20, 3, 2, 6, 2).astype(np.float64).mean(axis=(3, 5))
    np.testing.assert_allclose(fields, blocks, rtol=1e-6)  # the humidity: a fraction x 100
    np.testing.assert_allclose(lat, [60, 0, -60])
    np.testing.assert_allclose(lon, np.arange(6) * 60 + 15)


@pytest.mark.parametrize("new_names", [True, False], ids=["valid_time", "time"])
def test_cds_netcdf_files_with_new_and_old_names(tmp_path, new_names):
    source = cds_netcdf(tmp_path / "cds", [2017], rows=3, cols=4, new_names=new_names)
    prepare(source, tmp_path / "out", "--train_years", "2017", "--max_samples", "6")
    fields, lat, lon, hours, _ = read(tmp_path / "out" / "train" / "2017.h5")
    assert_known(fields, hours, lat, lon)  # the CDS `r` is in percent: bit for bit
    np.testing.assert_array_equal(lat, [90, 0, -90])


def test_a_leap_year_has_1464_samples_and_nothing_is_dropped(tmp_path):
    source = cds_netcdf(tmp_path / "cds", [2016], rows=2, cols=3)
    prepare(source, tmp_path / "out", "--train_years", "2016", "--batch_size", "128")
    fields, lat, lon, hours, _ = read(tmp_path / "out" / "train" / "2016.h5")
    assert fields.shape[0] == 1464
    last = np.datetime64("2016-12-31T18", "h") - np.datetime64("1970-01-01T00", "h")
    assert hours[-1] == last.astype(int) and (np.diff(hours) == 6).all()
    np.testing.assert_array_equal(fields[-3:], expected(hours[-3:], lat, lon))


def test_statistics_merged_from_each_year_equal_one_numpy_pass(arco, tmp_path):
    out = tmp_path / "out"
    prepare(arco, out, "--train_years", "2016-2017", "--max_samples", "12")
    years = [read(out / "train" / f"{y}.h5") for y in (2016, 2017)]
    x = np.concatenate([y[0] for y in years]).astype(np.float64)
    stats = {n: np.load(out / "stats" / f"{n}.npy") for n in ("global_means", "global_stds",
                                                               "time_means")}
    np.testing.assert_allclose(stats["global_means"], x.mean(axis=(0, 2, 3), keepdims=True),
                               rtol=1e-7)
    np.testing.assert_allclose(stats["global_stds"], x.std(axis=(0, 2, 3), keepdims=True),
                               rtol=1e-6)
    np.testing.assert_allclose(stats["time_means"], x.mean(axis=0, keepdims=True), rtol=1e-7)
    assert all(s.dtype == np.float32 for s in stats.values())
    # The exact merge, in float64: two years' sums added = one pass over both years.
    merged = PartialSums.load(out / "stats" / "partial" / "2016.npz").merge(
        PartialSums.load(out / "stats" / "partial" / "2017.npz"))
    means, stds = merged.means_and_stds()
    np.testing.assert_allclose(means.ravel(), x.mean(axis=(0, 2, 3)), rtol=1e-13)
    np.testing.assert_allclose(stds.ravel(), x.std(axis=(0, 2, 3)), rtol=1e-11)


def test_the_climatology_is_the_least_squares_fit_over_the_training_years(tmp_path):
    """Two whole years (6-hourly, a 2 x 3 grid): the harmonics numpy's least squares finds
    for the same samples and terms, and the mean 10 m wind speed."""
    source = cds_netcdf(tmp_path / "cds", [2016, 2017], rows=2, cols=3)
    out = tmp_path / "out"
    prepare(source, out, "--train_years", "2016-2017", "--batch_size", "256")
    years = [read(out / "train" / f"{y}.h5") for y in (2016, 2017)]
    x = np.concatenate([y[0] for y in years]).astype(np.float64)
    phase = np.concatenate([np.arange(1464) / 1464, np.arange(1460) / 1460])
    design = basis(phase, np.concatenate([y[3] for y in years]) % 24)
    coef, *_ = np.linalg.lstsq(design, x.reshape(len(x), -1), rcond=None)
    clim = np.load(out / "stats" / "climatology.npz")
    assert clim["coefficients"].shape == (14, 21, 2, 3)
    np.testing.assert_allclose(clim["coefficients"][:, :20].reshape(14, -1), coef, rtol=1e-5,
                               atol=1e-4)
    speed = np.hypot(x[:, 0], x[:, 1])
    np.testing.assert_allclose(clim["time_mean"][20], speed.mean(axis=0), rtol=1e-6)
    assert list(clim["channels"]) == [*CHANNEL_NAMES, "ws10"]


@pytest.mark.parametrize("kind, message", [
    ("channel", "lacks channel tcwv .total_column_water_vapour.: no variable "
                "'total_column_water_vapour' or 'tcwv'"),
    ("level", "lacks channel z50 .geopotential at 50 hPa.: 'geopotential' has levels 100, "
              "500, 700, 850, 925, 1000"),
    ("gap", "has a gap in time in 2016: no 10m_u_component_of_wind .u10. at 2016-01-02T12 "
            ".and 1 more."),
    ("year", "has no 10m_u_component_of_wind .u10. in 2018 .it covers 2016-01-01 to "
             "2016-01-03."),
    ("end", "has 10m_u_component_of_wind .u10. from 2016-01-01T00 to 2016-01-03T18: 1452 of "
            "the 1464 6-hourly times of 2016 are outside it .--max_samples N prepares only "
            "the first N of a year."),
])
def test_a_source_that_cannot_make_the_layout_is_refused_with_one_line(tmp_path, kind,
                                                                        message):
    skip = {"channel": ("tcwv",), "level": ("z50",)}.get(kind, ())
    source = wb2_zarr(tmp_path / "bad.zarr", [2016], days=3, skip=skip,
                      drop_times=2 if kind == "gap" else 0)
    year = "2018" if kind == "year" else "2016"
    limit = () if kind == "end" else ("--max_samples", "12")
    with pytest.raises(DataError, match=message) as error:
        prepare(source, tmp_path / "out", "--train_years", year, *limit)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out" / "train" / f"{year}.h5").exists()


def test_files_on_two_grids_are_refused(tmp_path):
    source = cds_netcdf(tmp_path / "cds", [2017], rows=3, cols=4, pressure_rows=5)
    with pytest.raises(DataError, match=r"mixes grids: .*era5_single_2017.nc is 3 x 4"):
        prepare(source, tmp_path / "out", "--train_years", "2017")


@pytest.mark.parametrize("flags, message", [
    (["--train_years", "2017-2016"], "'2017-2016' is not a range of years"),
    (["--train_years", "2016", "--test_years", "2016"],
     "year 2016 is in both --train_years and --test_years"),
    (["--train_years", "2016", "--coarsen", "4"], "--coarsen 4 does not divide the 7 x 12 "
                                                   "grid .ERA5's 721 rows: add --crop_rows 4"),
    (["--train_years", "2016", "--crop_rows", "9"], "--crop_rows 9: .* has only 7 rows"),
])
def test_bad_flags_are_one_line_errors(arco, tmp_path, capsys, flags, message):
    try:
        prepare(arco, tmp_path / "out", *flags)
    except DataError as e:
        line = str(e)
    except SystemExit as e:
        assert e.code == 2
        line = capsys.readouterr().err.strip()
        assert line.startswith("error: ") and "\n" not in line
    else:
        raise AssertionError("accepted")
    assert re.search(message, line), line


def test_a_finished_year_is_skipped_and_a_half_written_one_redone(arco, tmp_path, capsys):
    out = tmp_path / "out"
    flags = ("--train_years", "2016", "--test_years", "2017", "--max_samples", "4")
    prepare(arco, out, *flags)
    train, test = out / "train" / "2016.h5", out / "test" / "2017.h5"
    stamps = {p: p.stat().st_mtime_ns for p in (train, test)}
    prepare(arco, out, *flags)
    assert "2016.h5 is complete, skipped" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    # A crash mid-year leaves <year>.h5.partial, never <year>.h5; a file whose last step
    # (the `complete` mark) is missing, or made with other options, is written again.
    (out / "test" / "2017.h5.partial").write_bytes(b"half a year")
    with h5py.File(test, "a") as f:
        del f["fields"].attrs["complete"]
    prepare(arco, out, *flags)
    assert train.stat().st_mtime_ns == stamps[train] and test.stat().st_mtime_ns != stamps[test]
    assert not (out / "test" / "2017.h5.partial").exists()
    prepare(arco, out, *flags[:-1], "5")  # another --max_samples: every year again
    assert read(train)[0].shape[0] == 5 and read(test)[0].shape[0] == 5
    os.remove(out / "stats" / "partial" / "2016.npz")  # a training year without its sums
    prepare(arco, out, *flags[:-1], "5")
    assert (out / "stats" / "partial" / "2016.npz").exists()


def test_the_loaders_read_the_prepared_data(tmp_path):
    from helpers import CONFIG_FILE

    from data.dataset import ERA5Dataset
    from data.forecast import RolloutData
    from utils.config import read_config

    source = wb2_zarr(tmp_path / "era5.zarr", [2016, 2017, 2018], rows=9, cols=12, days=2)
    out = tmp_path / "out"
    prepare(source, out, "--train_years", "2016", "--valid_years", "2017", "--test_years",
            "2018", "--crop_rows", "8", "--max_samples", "8")
    cfg = read_config(CONFIG_FILE, "tiny", environ={"DATA_DIR": str(out)}).replace(
        img_size=[8, 12])
    data = ERA5Dataset(cfg, cfg.train_data_path, train=True)
    fields, lat, lon, hours, _ = read(out / "train" / "2016.h5")
    means, stds = np.load(out / "stats" / "global_means.npy")[0], np.load(
        out / "stats" / "global_stds.npy")[0]
    inp, tar = data[3]
    np.testing.assert_allclose(inp.numpy(), (fields[3] - means) / stds, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(tar.numpy(), (fields[4] - means) / stds, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(data.grid.latitude, lat)
    rollouts = RolloutData(cfg, cfg.inf_data_path)
    ics = rollouts.pick(2, 3)
    valid_hours, phase, hour = rollouts.valid_times(ics, 3)
    _, _, _, test_hours, _ = read(out / "test" / "2018.h5")
    np.testing.assert_array_equal(valid_hours[0], test_hours[ics[0].index:ics[0].index + 4])
    np.testing.assert_allclose(phase[0], (ics[0].index + np.arange(4)) / 1460)
    np.testing.assert_array_equal(hour[0], test_hours[ics[0].index:ics[0].index + 4] % 24)
    rollouts.close()
