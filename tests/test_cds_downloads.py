"""Every CDS download as it arrives (tests/cds_forms.py), and relative humidity in both
definitions (data/humidity.py), prepared as a user prepares them (era5/prepare.py's
`main`, in this process):

  - a zip of two NetCDF files saved as `.nc`, old-CDS per-level files without a level
    dimension beside a surface `z`, an `expver` pair (ERA5 + ERA5T) and a cfgrib
    conversion (`time` and `valid_time`): every channel's every value lands where it
    belongs, nothing of another field or time in its place; what cannot be read is one
    line naming the file;
  - WeatherBench-2's formula against hand-computed values; `--rh_definition` derives the
    other definition from specific humidity and records which one a file holds, or refuses
    in one line when the source has no specific humidity; relative humidity without units
    is told a fraction or percent by its range, and refused when the range says neither.
"""

from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pytest
import xarray as xr
from cds_forms import OROGRAPHY, cds_download, expected_fields
from era5_stores import EPOCH, arco_zarr, cds_netcdf, known, specific_humidity, wb2_zarr

from data.era5_names import CHANNEL_NAMES
from data.humidity import relative_humidity, saturation_vapour_pressure_over_water
from era5 import prepare as era5_prepare
from utils.errors import DataError

YEAR = ["--train_years", "2016", "--max_samples", "8"]
R500, R850 = CHANNEL_NAMES.index("r500"), CHANNEL_NAMES.index("r850")


def prepare(source, out, *flags: str) -> None:
    era5_prepare.main([str(source), str(out), *flags])


def year_file(out):
    with h5py.File(out / "train" / "2016.h5", "r") as f:
        return f["fields"][()], dict(f["fields"].attrs), f["time"][()]


def assert_every_channel_known(out, days: int = 2, rows: int = 5, cols: int = 8) -> None:
    fields, _, hours = year_file(out)
    want = expected_fields(2016, days, rows, cols, CHANNEL_NAMES)[:len(fields)]
    start = (np.datetime64("2016-01-01T00", "h") - EPOCH).astype(np.int64)
    np.testing.assert_array_equal(hours, start + 6 * np.arange(len(fields)))
    np.testing.assert_array_equal(fields, want)  # CDS `r` is percent: bit for bit


# ------------------------------------------------------------------ the forms
def test_a_zip_saved_as_nc_is_read_through_its_members(tmp_path, capsys):
    source = cds_download(tmp_path / "cds", 2016, "zip")
    prepare(source, tmp_path / "out", *YEAR)
    assert_every_channel_known(tmp_path / "out")
    assert "era5_single_2016.nc is a zip archive: extracted" in capsys.readouterr().err
    members = sorted(f for f in os.listdir(source) if f.startswith("era5_single_2016_"))
    assert members == ["era5_single_2016_data_stream-oper_stepType-accum.nc",
                       "era5_single_2016_data_stream-oper_stepType-instant.nc"]
    prepare(source, tmp_path / "again", *YEAR)  # extracted once: the second run reads them
    assert "extracted" not in capsys.readouterr().err
    np.testing.assert_array_equal(year_file(tmp_path / "again")[0],
                                  year_file(tmp_path / "out")[0])


def test_old_cds_files_without_a_level_read_it_from_their_name_and_keep_surface_z_apart(
        tmp_path):
    source = cds_download(tmp_path / "cds", 2016, "per_level")
    prepare(source, tmp_path / "out", *YEAR)
    assert_every_channel_known(tmp_path / "out")  # z500 is z at 500 hPa, not the orography
    fields = year_file(tmp_path / "out")[0]
    assert not (fields == OROGRAPHY).any()
    os.remove(source / "era5_pressure_2016_500.nc")
    with pytest.raises(DataError, match=r"lacks channel u500 .*'u' has levels 50, 850, "
                                        r"1000") as error:
        prepare(source, tmp_path / "out2", *YEAR)
    assert "\n" not in str(error.value)


def test_a_surface_z_is_named_when_a_level_of_z_is_missing(tmp_path):
    source = cds_download(tmp_path / "cds", 2016, "per_level")
    single = xr.open_dataset(source / "era5_pressure_2016_500.nc")
    single.drop_vars("z").to_netcdf(source / "era5_pressure_2016_500hPa.nc")
    single.close()
    os.remove(source / "era5_pressure_2016_500.nc")
    with pytest.raises(DataError, match=r"lacks channel z500 \(geopotential at 500 hPa\): "
                                        r"'z' has levels 50, 850, 1000; .*era5_single_2016"
                                        r"\.nc hold\(s\) a surface 'z', kept apart"):
        prepare(source, tmp_path / "out", *YEAR)


def test_a_level_that_cannot_be_read_is_refused_naming_the_file(tmp_path):
    source = cds_download(tmp_path / "cds", 2016, "per_level")
    os.rename(source / "era5_pressure_2016_850.nc", source / "era5_pressure_2016_x.nc")
    with pytest.raises(DataError, match=r"era5_pressure_2016_x\.nc: '\w+' has no level "
                                        r"dimension and neither the file's name nor its "
                                        r"attributes give one: .*era5_pressure_2016_x_500hPa"
                                        r"\.nc") as error:
        prepare(source, tmp_path / "out", *YEAR)
    assert "\n" not in str(error.value)


def test_an_expver_pair_takes_each_time_from_the_experiment_that_holds_it(tmp_path):
    source = cds_download(tmp_path / "cds", 2016, "expver")
    prepare(source, tmp_path / "out", *YEAR)
    assert_every_channel_known(tmp_path / "out")  # ERA5 for 4 times, ERA5T for 4


def test_a_cfgrib_conversion_is_read_at_its_valid_times(tmp_path):
    source = cds_download(tmp_path / "cds", 2016, "cfgrib")
    prepare(source, tmp_path / "out", *YEAR)  # `time` is 6 h earlier: not the field's
    assert_every_channel_known(tmp_path / "out")


@pytest.mark.parametrize("content, message", [
    (b"GRIB" + bytes(60), r"bad\.nc is a GRIB file, not NetCDF"),
    (b"not a netcdf file at all", r"bad\.nc: not a NetCDF file xarray can open"),
], ids=["grib", "garbage"])
def test_a_file_that_is_not_netcdf_is_named_in_one_line(tmp_path, content, message):
    source = cds_netcdf(tmp_path / "cds", [2016], rows=3, cols=4, months=1)
    (source / "bad.nc").write_bytes(content)
    with pytest.raises(DataError, match=message) as error:
        prepare(source, tmp_path / "out", *YEAR)
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------ two definitions
@pytest.mark.parametrize("t, pascal", [
    (273.15, 611.2),    # 611.2 exp(0)
    (300.0, 3534.52),   # 611.2 exp(17.67 x 26.85 / 270.35)
    (260.0, 222.894),   # 611.2 exp(17.67 x -13.15 / 230.35)
    (240.0, 37.7403),   # 611.2 exp(17.67 x -33.15 / 210.35)
])
def test_saturation_over_water_is_boltons(t, pascal):
    assert saturation_vapour_pressure_over_water(np.array([t]))[0] == pytest.approx(
        pascal, rel=1e-5)


@pytest.mark.parametrize("q, t, hpa, wb2, ecmwf", [
    # WB2: w = q / (1 - q) over w_s = 0.622 e_s / (p - e_s); ECMWF: e / e_sat (mixed phase)
    (0.001, 260.0, 500, 0.359398, 0.400951),  # w_s = 0.622 x 222.894 / 49777.1 = 2.78522e-3
    (0.01, 290.0, 850, 0.703450, 0.708477),   # above 0 C: both over water, nearly equal
    (0.0001, 240.0, 500, 0.212858, 0.295371),  # ice: the mixed phase's e_sat is lower
])
def test_both_definitions_by_hand(q, t, hpa, wb2, ecmwf):
    args = (np.array(q), np.array(t), 100.0 * hpa)
    assert relative_humidity(*args, definition="wb2") == pytest.approx(wb2, rel=1e-5)
    assert relative_humidity(*args, definition="ecmwf") == pytest.approx(ecmwf, rel=1e-5)


def wb2_by_hand(q, t, pa):
    """WeatherBench-2's relative humidity (a fraction), written out."""
    e_s = 611.2 * np.exp(17.67 * (t - 273.15) / (t - 29.65))
    return (q / (1 - q)) / (0.622 * e_s / (pa - e_s))


def test_rh_definition_derives_the_other_from_specific_humidity_and_is_recorded(tmp_path):
    arco = arco_zarr(tmp_path / "arco.zarr", [2016], days=2)
    prepare(arco, tmp_path / "own", *YEAR)
    prepare(arco, tmp_path / "wb2", *YEAR, "--rh_definition", "wb2")
    (own, own_attrs, hours), (wb2, wb2_attrs, _) = (year_file(tmp_path / n)
                                                     for n in ("own", "wb2"))
    assert own_attrs["rh_definition"] == "ecmwf" and wb2_attrs["rh_definition"] == "wb2"
    assert "WeatherBench-2's formula, over water" in wb2_attrs["channel_sources"][R500]
    lat, lon = np.linspace(90, -90, 7), np.arange(12) * 30.0
    for c, level in ((R500, 500), (R850, 850)):
        t = known(f"t{level}", hours, lat, lon).astype(np.float64)
        q = specific_humidity(known(f"r{level}", hours, lat, lon), t, 100.0 * level)
        q = q.astype(np.float32).astype(np.float64)  # as the store holds it
        np.testing.assert_allclose(wb2[:, c], 100 * wb2_by_hand(q, t, 100.0 * level),
                                   rtol=1e-5)
    np.testing.assert_array_equal(np.delete(wb2, [R500, R850], 1),
                                  np.delete(own, [R500, R850], 1))
    assert (wb2[:, R500] < own[:, R500]).all()  # below 0 C over water is the lower one


def test_a_wb2_store_gives_its_own_and_ecmwfs_from_its_specific_humidity(tmp_path):
    store = wb2_zarr(tmp_path / "wb2.zarr", [2016], days=2, with_q=True)
    prepare(store, tmp_path / "own", *YEAR)
    prepare(store, tmp_path / "ecmwf", *YEAR, "--rh_definition", "ecmwf")
    (own, own_attrs, hours), (ecmwf, ecmwf_attrs, _) = (year_file(tmp_path / n)
                                                         for n in ("own", "ecmwf"))
    assert own_attrs["rh_definition"] == "wb2" and ecmwf_attrs["rh_definition"] == "ecmwf"
    assert own_attrs["channel_sources"][R500] == "relative_humidity at 500 hPa x 100"
    lat, lon = np.linspace(90, -90, 7), np.arange(12) * 30.0
    np.testing.assert_allclose(ecmwf[:, R500], known("r500", hours, lat, lon), rtol=1e-5)


def test_the_other_definition_without_specific_humidity_is_refused_in_one_line(tmp_path):
    source = cds_netcdf(tmp_path / "cds", [2016], rows=3, cols=4, months=1)
    with pytest.raises(DataError, match=r"relative humidity at 500 hPa \('r'\) is ECMWF's "
                                        r"\(IFS, mixed phase\); WeatherBench-2's \(over water, "
                                        r"Bolton 1980\) is derived from specific humidity .* "
                                        r"or prepare with --rh_definition ecmwf") as error:
        prepare(source, tmp_path / "out", *YEAR, "--rh_definition", "wb2")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out" / "train" / "2016.h5").exists()


def test_a_second_run_with_another_definition_writes_the_year_again(tmp_path):
    store = wb2_zarr(tmp_path / "wb2.zarr", [2016], days=2, with_q=True)
    prepare(store, tmp_path / "out", *YEAR)
    prepare(store, tmp_path / "out", *YEAR, "--rh_definition", "ecmwf")
    assert year_file(tmp_path / "out")[1]["rh_definition"] == "ecmwf"


# ------------------------------------------------------------------ units by range
def _without_units(store, scale: float = 1.0):
    import zarr

    group = zarr.open_group(str(store), mode="r+")
    rh = group["relative_humidity"]
    del rh.attrs["units"]
    if scale != 1.0:
        rh[...] = rh[...] * scale
    zarr.consolidate_metadata(str(store))
    return store


def test_humidity_without_units_is_a_fraction_or_percent_by_its_range(tmp_path):
    store = _without_units(wb2_zarr(tmp_path / "wb2.zarr", [2016], days=2))
    prepare(store, tmp_path / "fraction", *YEAR)
    cds = cds_netcdf(tmp_path / "cds", [2016], rows=7, cols=12, months=1)
    for path in cds.glob("*pressure*"):
        ds = xr.open_dataset(path)
        ds["r"].attrs.pop("units")
        ds.load().to_netcdf(path.with_suffix(".tmp"))
        ds.close()
        shutil.move(path.with_suffix(".tmp"), path)
    prepare(cds, tmp_path / "percent", *YEAR)
    a, b = (year_file(tmp_path / n)[0] for n in ("fraction", "percent"))
    np.testing.assert_allclose(a[:, R500], b[:, R500], rtol=1e-6)
    assert 20 < a[:, R500].min() and a[:, R500].max() < 90


def test_humidity_without_units_and_an_ambiguous_range_is_refused(tmp_path):
    store = _without_units(wb2_zarr(tmp_path / "wb2.zarr", [2016], days=2), scale=3.0)
    with pytest.raises(DataError, match=r"'relative_humidity' has no units attribute and "
                                        r"values .* neither a fraction \(at most 1.5\) nor "
                                        r"percent \(5 \.\. 200\); give it units") as error:
        prepare(store, tmp_path / "out", *YEAR)
    assert "\n" not in str(error.value)
