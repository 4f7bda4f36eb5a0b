"""CDS downloads in the forms they arrive in, made from the known fields of
tests/era5_stores.py (`known`: every value says its channel, row, column and time):

    cds_download(dir, year, "zip")        the new CDS's zip of two NetCDF files (the
                                          request mixed step types), saved as `.nc`: the
                                          instantaneous single-level variables in one
                                          member, an accumulation (`tp`) in the other
    cds_download(dir, year, "per_level")  the old CDS's one file per pressure level, the
                                          level dimension dropped (`time`, no `level`;
                                          the level only in the file name), beside a
                                          single-level file that holds the surface
                                          geopotential `z` (orography) too
    cds_download(dir, year, "expver")     a file spanning ERA5 and ERA5T: an `expver`
                                          dimension of two (1 and 5), each time's values
                                          in one experiment, NaN in the other
    cds_download(dir, year, "cfgrib")     a cfgrib conversion of forecasts valid at the
                                          times: `time` the reference time (6 h earlier),
                                          `step` 6 h, `valid_time`, levels as
                                          `isobaricInhPa`, scalar `number` and `surface`

Each form is one year's first `days` days, 6-hourly, with every channel the data needs.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
from era5_stores import EPOCH, _variables, grid, known, times

HOUR = np.timedelta64(1, "h")
OROGRAPHY = 1234.5  # the surface geopotential's value everywhere (m2/s2): no channel's


def _datasets(year: int, days: int, rows: int, cols: int):
    """(single-level dataset, pressure-level dataset) with the CDS short names."""
    import xarray as xr

    when = times([year], 6, days)
    lat, lon = grid(rows, cols)
    single, pressure, levels = _variables(when, lat, lon, True, "percent")
    coords = {"time": when.astype("datetime64[ns]"), "latitude": ("latitude", lat),
              "longitude": ("longitude", lon)}
    return (xr.Dataset(single, coords=coords),
            xr.Dataset(pressure, coords={**coords, "level": ("level", np.asarray(
                levels, dtype=np.float64), {"units": "hPa"})}))


def cds_download(directory: Path, year: int, form: str, days: int = 2, rows: int = 5,
                 cols: int = 8) -> Path:
    """The directory with one year's download in `form` (module docstring)."""
    directory.mkdir(parents=True, exist_ok=True)
    single, pressure = _datasets(year, days, rows, cols)
    {"zip": _zip, "per_level": _per_level, "expver": _expver,
     "cfgrib": _cfgrib}[form](directory, year, single, pressure)
    return directory


def _new_names(ds):
    ds = ds.rename({k: v for k, v in (("time", "valid_time"), ("level", "pressure_level"))
                    if k in ds.coords})
    return ds.assign_coords(number=0, expver=("valid_time", ["0001"] * ds.sizes["valid_time"]))


def _zip(directory: Path, year: int, single, pressure) -> None:
    accum = single[["u10"]].rename(u10="tp")
    accum["tp"] = accum["tp"] * 0 + np.float32(0.001)
    accum["tp"].attrs = {"units": "m", "GRIB_stepType": "accum"}
    members = {"data_stream-oper_stepType-instant.nc": _new_names(single),
               "data_stream-oper_stepType-accum.nc": _new_names(accum)}
    with zipfile.ZipFile(directory / f"era5_single_{year}.nc", "w") as z:
        for name, ds in members.items():
            path = directory / f"member_{name}"
            ds.to_netcdf(path)
            z.write(path, name)
            path.unlink()
    _new_names(pressure).to_netcdf(directory / f"era5_pressure_{year}.nc")


def _per_level(directory: Path, year: int, single, pressure) -> None:
    surface = single.copy()
    surface["z"] = (("time", "latitude", "longitude"),
                    np.full(single["u10"].shape, OROGRAPHY, dtype=np.float32),
                    {"units": "m**2 s**-2", "long_name": "Geopotential"})
    surface.to_netcdf(directory / f"era5_single_{year}.nc")
    for level in pressure.level.values:
        one = pressure.sel(level=level).drop_vars("level")  # the level dimension dropped
        one.to_netcdf(directory / f"era5_pressure_{year}_{int(level)}.nc")


def _expver(directory: Path, year: int, single, pressure) -> None:
    """ERA5 (expver 1) holds the first half of the times, ERA5T (5) the rest."""
    import xarray as xr

    for kind, ds in (("single", single), ("pressure", pressure)):
        n = ds.sizes["time"]
        era5 = ds.copy(deep=True)
        era5t = ds.copy(deep=True)
        for name in ds.data_vars:
            era5[name][n // 2:] = np.nan
            era5t[name][:n // 2] = np.nan
        both = xr.concat([era5, era5t], dim="expver")
        both = both.assign_coords(expver=("expver", [1, 5]))
        both.to_netcdf(directory / f"era5_{kind}_{year}.nc")


def _cfgrib(directory: Path, year: int, single, pressure) -> None:
    for kind, ds in (("single", single), ("pressure", pressure)):
        valid = ds["time"].values
        ds = ds.assign_coords(time=valid - np.timedelta64(6, "h"),
                              valid_time=("time", valid), step=np.timedelta64(6, "h"),
                              number=0)
        ds = ds.rename(level="isobaricInhPa") if "level" in ds.dims else ds.assign_coords(
            surface=0.0)
        ds.to_netcdf(directory / f"era5_{kind}_{year}.nc")


def expected_fields(year: int, days: int, rows: int, cols: int, names) -> np.ndarray:
    """(T, len(names), H, W) known values of the channels `names` at the form's times."""
    when = times([year], 6, days)
    lat, lon = grid(rows, cols)
    hours = (when - EPOCH).astype(np.int64)
    return np.stack([known(n, hours, lat, lon) for n in names], axis=1)
