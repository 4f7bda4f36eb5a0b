"""Reading the public ERA5 layouts as they are (era5/source.py, era5/source_files.py,
data/humidity.py), on small stores made here (tests/era5_stores.py), without a network:

  - relative humidity with the IFS formula (mixed phase) against hand-computed values, and
    derived from ARCO-ERA5's specific humidity; one unit (percent) whatever the source, the
    units and the origin of every channel recorded in the files;
  - ARCO's `valid_time_stop` honoured; a NaN or infinity in a requested year, and a missing
    value in a coordinate, refused in one line naming where, with nothing written;
  - CDS downloads split by variable, level and month in any mix read as one file; a level
    no file holds and a missing month refused;
  - URLs (served over HTTP from this process), a wrong path, an unreachable host and a
    missing gcsfs each one line; a 65-year store opened at the cost of the years asked for.
"""

from __future__ import annotations

import functools
import http.server
import os
import sys
import threading

import h5py
import numpy as np
import pytest
from era5_stores import arco_zarr, cds_netcdf, known, poke, wb2_zarr

from data.era5_names import CHANNEL_NAMES, CHANNELS
from data.humidity import relative_humidity, saturation_vapour_pressure
from era5 import prepare as era5_prepare
from era5.source import Source
from utils.errors import DataError

R500 = CHANNEL_NAMES.index("r500")
WB2_LEVELS = [50, 100, 500, 700, 850, 925, 1000]  # the levels of the tests' WeatherBench-2 stores


def prepare(source, out, *flags: str) -> None:
    era5_prepare.main([str(source), str(out), *flags])


def fields_of(path):
    with h5py.File(path, "r") as f:
        return f["fields"][()], dict(f["fields"].attrs), f["time"][()], f["latitude"][()], \
            f["longitude"][()]


# ------------------------------------------------------------------ humidity
@pytest.mark.parametrize("t, pascal", [
    (273.16, 611.21),   # T0: water and ice agree, 611.21 Pa
    (300.0, 3531.6),    # water: 611.21 exp(17.502 x 26.84 / 267.81)
    (250.16, 77.058),   # Ti: ice alone, 611.21 exp(22.587 x -23 / 250.86)
    (230.0, 8.9334),    # ice: 611.21 exp(22.587 x -43.16 / 230.7)
    (260.0, 200.37),    # mixed: alpha (9.84 / 23)^2 = 0.18304 of 222.38 + the rest of 195.44
])
def test_saturation_over_water_ice_and_the_mixed_phase_is_the_ifs_formula(t, pascal):
    assert saturation_vapour_pressure(np.array([t]))[0] == pytest.approx(pascal, rel=1e-4)


@pytest.mark.parametrize("q, t, hpa, rh", [
    # e = p q (Rv/Rd) / (1 + (Rv/Rd - 1) q), Rv/Rd = 461.5250 / 287.0597 = 1.60776
    (0.001, 260.0, 500, 0.40095),  # e = 80.340 Pa over e_sat 200.37 Pa (mixed phase)
    (0.01, 290.0, 850, 0.70848),   # e = 1358.3 Pa over e_sat 1917.3 Pa (water)
])
def test_relative_humidity_from_specific_humidity_by_hand(q, t, hpa, rh):
    assert relative_humidity(np.array(q), np.array(t), 100.0 * hpa) == pytest.approx(rh,
                                                                                     rel=1e-4)


def test_arco_relative_humidity_is_derived_in_percent_and_its_origin_recorded(tmp_path):
    source = arco_zarr(tmp_path / "arco.zarr", [2016], days=2)
    prepare(source, tmp_path / "out", "--train_years", "2016", "--max_samples", "8")
    fields, attrs, hours, lat, lon = fields_of(tmp_path / "out" / "train" / "2016.h5")
    for name in ("r500", "r850"):
        c = CHANNEL_NAMES.index(name)
        np.testing.assert_allclose(fields[:, c], known(name, hours, lat, lon), rtol=1e-5)
    assert list(attrs["channel_units"]) == [c.units for c in CHANNELS]
    assert attrs["channel_units"][R500] == "%"
    sources = list(attrs["channel_sources"])
    assert sources[R500].startswith("derived: relative humidity from specific_humidity at "
                                    "500 hPa, temperature at 500 hPa (IFS formula")
    assert sources[CHANNEL_NAMES.index("z50")] == "geopotential at 50 hPa"


def test_one_humidity_unit_whatever_the_source(tmp_path):
    """WeatherBench-2's fraction and the CDS percent give the same prepared percent."""
    wb2 = wb2_zarr(tmp_path / "wb2.zarr", [2017], days=2)
    cds = cds_netcdf(tmp_path / "cds", [2017])
    for name, source in (("wb2", wb2), ("cds", cds)):
        prepare(source, tmp_path / name, "--train_years", "2017", "--max_samples", "4")
    (a, attrs_a, *_), (b, attrs_b, *_) = (fields_of(tmp_path / n / "train" / "2017.h5")
                                          for n in ("wb2", "cds"))
    np.testing.assert_allclose(a, b, rtol=1e-6)
    assert 20 < a[:, R500].min() and a[:, R500].max() < 90  # percent, not a fraction
    assert attrs_a["channel_sources"][R500] == "relative_humidity at 500 hPa x 100"
    assert attrs_b["channel_sources"][R500] == "r at 500 hPa"


def test_a_humidity_in_unknown_units_is_refused(tmp_path):
    import zarr

    store = wb2_zarr(tmp_path / "wb2.zarr", [2017], days=1)
    zarr.open_group(str(store), mode="r+")["relative_humidity"].attrs["units"] = "g/kg"
    zarr.consolidate_metadata(str(store))
    with pytest.raises(DataError, match="'relative_humidity' has units 'g/kg'; relative "
                                        "humidity must be in percent"):
        prepare(store, tmp_path / "out", "--train_years", "2017", "--max_samples", "4")


# ------------------------------------------------------------------ times, NaN, coordinates
def test_arco_times_after_valid_time_stop_are_refused_and_before_it_read(tmp_path):
    source = arco_zarr(tmp_path / "arco.zarr", [2016], days=4, stop_day=2)
    prepare(source, tmp_path / "ok", "--train_years", "2016", "--max_samples", "8")  # 2 days
    with pytest.raises(DataError, match=r"has 10m_u_component_of_wind \(u10\) from "
                                        r"2016-01-01T00 to 2016-01-02T18 \(its "
                                        r"valid_time_stop 2016-01-02\): 1 of the 9 6-hourly"):
        prepare(source, tmp_path / "out", "--train_years", "2016", "--max_samples", "9")
    assert not (tmp_path / "out" / "train" / "2016.h5").exists()


@pytest.mark.parametrize("value, what", [(np.nan, "NaN"), (np.inf, "infinite")])
def test_a_nan_or_infinity_names_variable_level_and_time_and_nothing_is_written(
        tmp_path, value, what):
    store = wb2_zarr(tmp_path / "wb2.zarr", [2016], days=3)
    poke(store, "temperature", (9, WB2_LEVELS.index(500), 2, 3), value)  # 2016-01-03T06
    out = tmp_path / "out"
    with pytest.raises(DataError, match=rf"wb2.zarr: temperature at 500 hPa \(t500\) "
                                        rf"has 1 {what} value\(s\) at 2016-01-03T06; nothing "
                                        "of 2016 was written") as error:
        prepare(out.parent / "wb2.zarr", out, "--train_years", "2016", "--max_samples", "12",
                "--batch_size", "4")
    assert "\n" not in str(error.value)
    assert not list((out / "train").iterdir()) and not (out / "stats").exists()


def test_a_missing_value_in_a_coordinate_is_named(tmp_path):
    store = wb2_zarr(tmp_path / "wb2.zarr", [2016], days=1)
    poke(store, "longitude", (5,), np.nan)
    with pytest.raises(DataError, match=r"coordinate longitude has 1 missing value\(s\) "
                                        r"\(NaN\), the first at index 5 of 12"):
        prepare(store, tmp_path / "out", "--train_years", "2016", "--max_samples", "4")


# ------------------------------------------------------------------ CDS downloads, split
def test_cds_files_split_by_variable_level_and_month_read_as_one(tmp_path):
    whole = cds_netcdf(tmp_path / "whole", [2016], rows=3, cols=4, months=2)
    split = cds_netcdf(tmp_path / "split", [2016], rows=3, cols=4, months=2,
                       split=("variable", "level", "month"))
    assert len(os.listdir(split)) == 2 * (6 + 5 * 4)  # 6 variables; 5 on 4 levels
    for name, source in (("whole", whole), ("split", split)):
        prepare(source, tmp_path / f"out_{name}", "--train_years", "2016", "--max_samples",
                "130")  # into February
    first = fields_of(tmp_path / "out_whole" / "train" / "2016.h5")[0]
    np.testing.assert_array_equal(fields_of(tmp_path / "out_split" / "train" / "2016.h5")[0],
                                  first)


def test_cds_split_with_a_month_or_a_level_missing_is_refused(tmp_path):
    source = cds_netcdf(tmp_path / "cds", [2016], rows=3, cols=4, months=3,
                        split=("level", "month"))
    os.remove(source / "era5_pressure_2016_850_02.nc")  # t, u, v, z, r at 850 in February
    quarter = ("--train_years", "2016", "--max_samples", str(4 * (31 + 29 + 31)))
    with pytest.raises(DataError, match=r"has a gap in time in 2016: no t at 850 hPa "
                                        r"\(t850\) at 2016-02-01T00 \(and 115 more\)"):
        prepare(source, tmp_path / "out", *quarter)
    for month in range(1, 4):
        os.remove(source / f"era5_pressure_2016_50_{month:02d}.nc")
    with pytest.raises(DataError, match=r"lacks channel z50 \(geopotential at 50 hPa\): 'z' "
                                        "has levels 500, 850, 1000"):
        prepare(source, tmp_path / "out", *quarter)


# ------------------------------------------------------------------ URLs, paths, long stores
@pytest.fixture
def served(tmp_path):
    """The directory tmp_path over HTTP on a local port (a URL source without a network)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_store_at_a_url_reads_as_the_same_store_on_disk(tmp_path, served):
    wb2_zarr(tmp_path / "era5.zarr", [2016], days=1)
    prepare(f"{served}/era5.zarr", tmp_path / "remote", "--train_years", "2016",
            "--max_samples", "4")
    prepare(tmp_path / "era5.zarr", tmp_path / "local", "--train_years", "2016",
            "--max_samples", "4")
    np.testing.assert_array_equal(fields_of(tmp_path / "remote" / "train" / "2016.h5")[0],
                                  fields_of(tmp_path / "local" / "train" / "2016.h5")[0])


def test_wrong_path_unreachable_host_and_missing_gcsfs_are_one_line_each(
        tmp_path, served, monkeypatch):
    first, end = np.datetime64("2016-01-01T00", "h"), np.datetime64("2017-01-01T00", "h")
    cases = [(f"{served}/nothing.zarr", "nothing.zarr: no Zarr store there"),
             ("http://127.0.0.1:1/era5.zarr", "cannot reach 127.0.0.1:1 to read "
                                             "http://127.0.0.1:1/era5.zarr"),
             (str(tmp_path / "nowhere"), "nowhere does not exist")]
    for url, message in cases:
        with pytest.raises(DataError, match=message) as error:
            Source(url, first, end)
        assert "\n" not in str(error.value)
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as on a machine without it
    with pytest.raises(DataError, match="reading gs://weatherbench2/x.zarr needs the gcsfs "
                                        "package, which is not installed"):
        Source("gs://weatherbench2/x.zarr", first, end)


def test_a_65_year_store_is_opened_at_the_cost_of_the_year_asked_for(tmp_path):
    """WeatherBench-2's time axis (1959-01-01 .. 2023-01-10, 93,544 times, one per chunk):
    the datasets are cut to the year before anything reads them, no dask graph is built,
    and a batch reads its own times."""
    from bench.era5_replica import build

    store = build(tmp_path / "wb2_64x32.zarr", [2016], days=2)
    source = Source(str(store), np.datetime64("2016-01-01T00", "h"),
                    np.datetime64("2017-01-01T00", "h"))
    assert source.grid.shape == (32, 64) and source.grid.latitude[0] == 87.1875
    for f in source.fields:
        for piece, _ in f.pieces:
            assert len(piece.opened.hours) == 1464 and piece.array.chunks is None
            whole = [np.datetime64(t, "h") - np.datetime64("1970-01-01T00", "h")
                     for t in ("1959-01-01T00", "2023-01-10T18")]
            assert piece.opened.span == tuple(int(h / np.timedelta64(1, "h")) for h in whole)
    # A variable's levels share its chunks: one array read per variable, not per level.
    assert len({id(p) for f in source.fields for p, _ in f.pieces}) == 11
    source.select_year(2016, 8)
    x = source.read(0, 8)
    assert x.shape == (8, 20, 32, 64) and np.isfinite(x).all()
