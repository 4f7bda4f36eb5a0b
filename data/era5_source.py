"""ERA5 as the public copies hold it, opened lazily: the 20 channels of any 6-hourly time.

Two kinds of source (docs/real_era5.md says where to get them):

  - a Zarr store in the WeatherBench-2 / ARCO-ERA5 layout: long variable names
    (`10m_u_component_of_wind`, `geopotential` with a `level` coordinate in hPa, ...),
    `time` hourly (ARCO) or 6-hourly (WeatherBench-2), `latitude` from north to south or
    (some WeatherBench-2 grids) ascending, `longitude` from 0 degrees east. A local path or
    a URL (gs://... needs the gcsfs package);
  - Copernicus CDS NetCDF files, a directory of them (or one file): short names (`u10`,
    `z`, ...), levels as `pressure_level` (older files: `level`), time as `valid_time`
    (older: `time`); single-level and pressure-level variables in separate files, years or
    months in separate files: they are joined along time.

xarray opens both (the netCDF4 engine reads the NetCDF-4 files the CDS serves now and the
NetCDF-3 files it served before; zarr the stores), with dask arrays: nothing is read until
`read` asks for a batch of times, and then only those times of the 20 channels.

Every channel is checked when the source is opened (a missing variable or level is a
one-line DataError naming it), every variable must be on the same grid (else "mixes
grids"), and `year_times` checks that every 6-hourly time of a requested year is there.
Fields come out with rows from north to south and columns from 0 degrees east, as float32
in the source's units (geopotential in m2/s2).
"""

from __future__ import annotations

import glob
import os
from typing import Any

import numpy as np

from data.era5_names import CHANNELS, Channel
from data.grid import Grid
from utils.errors import DataError

_RENAME = {"valid_time": "time", "pressure_level": "level", "lat": "latitude",
           "lon": "longitude", "isobaricInhPa": "level"}
HOUR = np.timedelta64(1, "h")


def _is_zarr(path: str) -> bool:
    if "://" in path:
        return True
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m))
                                       for m in (".zgroup", ".zmetadata", "zarr.json"))


def _open_datasets(path: str) -> list[tuple[str, Any]]:
    """[(where, xarray.Dataset)]: the store, or every NetCDF file of the directory."""
    import xarray as xr

    try:
        if _is_zarr(path):
            # The public buckets are read anonymously (gs:// needs the gcsfs package).
            options = {"token": "anon"} if path.startswith("gs://") else None
            return [(path, xr.open_zarr(path, chunks={}, storage_options=options))]
        if os.path.isfile(path):
            files = [path]
        elif os.path.isdir(path):
            files = sorted(f for ext in ("nc", "nc4", "netcdf")
                           for f in glob.glob(os.path.join(path, f"*.{ext}")))
            if not files:
                raise DataError(f"{path}: no Zarr store and no NetCDF files (*.nc) in it")
        else:
            raise DataError(f"source {path} does not exist")
        return [(f, xr.open_dataset(f, chunks={})) for f in files]
    except (OSError, ValueError, KeyError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"cannot open {path} as a Zarr store or NetCDF files "
                        f"({str(e).splitlines()[0]})") from None


def _normalised(ds: Any) -> Any:
    """The dataset with the public stores' names for time, level, latitude and longitude,
    and singleton dimensions (ensemble member `number`, `expver`) dropped."""
    ds = ds.rename({k: v for k, v in _RENAME.items() if k in ds.variables})
    for name in ("number", "expver"):
        if name in ds.dims and ds.sizes[name] == 1:
            ds = ds.isel({name: 0})
    return ds


class Source:
    """The 20 channels of an ERA5 source (module docstring), each a lazy (time, latitude,
    longitude) array on one grid."""

    def __init__(self, path: str):
        self.path = path
        pieces: dict[str, list[tuple[str, Any]]] = {}
        for where, ds in _open_datasets(path):
            ds = _normalised(ds)
            for name in ds.data_vars:
                pieces.setdefault(str(name), []).append((where, ds[name]))
        self._grid_of: tuple[str, np.ndarray, np.ndarray] | None = None
        self.arrays = {c.name: self._channel(c, pieces) for c in CHANNELS}
        where, lat, lon = self._grid_of
        self._flip = len(lat) > 1 and lat[0] < lat[-1]
        lon = np.mod(lon, 360.0)
        self._columns = np.argsort(lon, kind="stable")
        self._reorder = not np.array_equal(self._columns, np.arange(len(lon)))
        self.grid = Grid((lat[::-1] if self._flip else lat).copy(), lon[self._columns])
        if not (np.diff(self.grid.latitude) < 0).all() or not (
                np.diff(self.grid.longitude) > 0).all():
            raise DataError(f"{where}: latitude and longitude must be monotonic")
        self._index: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ opening
    def _channel(self, c: Channel, pieces: dict[str, list[tuple[str, Any]]]) -> Any:
        """One channel as a (time, latitude, longitude) DataArray joined over files."""
        import xarray as xr

        found = pieces.get(c.variable) or pieces.get(c.short)
        what = c.variable + (f" at {c.level} hPa" if c.level is not None else "")
        if not found:
            names = ", ".join(sorted(pieces)) or "none"
            raise DataError(f"{self.path} lacks channel {c.name} ({what}): no variable "
                            f"'{c.variable}' or '{c.short}' (variables: {names})")
        arrays = []
        for where, da in found:
            if c.level is not None:
                if "level" not in da.coords:
                    raise DataError(f"{where} lacks channel {c.name} ({what}): "
                                    f"'{da.name}' has no level coordinate")
                levels = np.asarray(da["level"].values).reshape(-1)
                if not np.isclose(levels, c.level).any():
                    raise DataError(f"{where} lacks channel {c.name} ({what}): "
                                    f"'{da.name}' has levels "
                                    f"{', '.join(f'{v:g}' for v in levels)}")
                da = da.sel(level=levels[np.isclose(levels, c.level)][0])
                da = da.drop_vars("level")
            dims = set(da.dims)
            if dims != {"time", "latitude", "longitude"}:
                raise DataError(f"{where}: '{da.name}' has dimensions {tuple(da.dims)}, "
                                "expected time, latitude, longitude (and level)")
            self._same_grid(where, da)
            arrays.append(da.transpose("time", "latitude", "longitude"))
        joined = arrays[0] if len(arrays) == 1 else xr.concat(arrays, dim="time")
        return joined.sortby("time").drop_duplicates("time")

    def _same_grid(self, where: str, da: Any) -> None:
        lat = np.asarray(da["latitude"].values, dtype=np.float64)
        lon = np.asarray(da["longitude"].values, dtype=np.float64)
        if self._grid_of is None:
            self._grid_of = (where, lat, lon)
            return
        first, lat0, lon0 = self._grid_of
        if lat.shape != lat0.shape or lon.shape != lon0.shape or not (
                np.allclose(lat, lat0) and np.allclose(lon, lon0)):
            raise DataError(f"{self.path} mixes grids: {where} is {len(lat)} x {len(lon)} "
                            f"(latitude {lat[0]:g} .. {lat[-1]:g}), {first} is {len(lat0)} x "
                            f"{len(lon0)} (latitude {lat0[0]:g} .. {lat0[-1]:g})")

    # ------------------------------------------------------------------ times
    def select_year(self, year: int, limit: int | None = None) -> np.ndarray:
        """Choose the year `read` reads: its 6-hourly times from 00 UTC on 1 January (the
        first `limit`), each checked to be in every channel (datetime64[h]); a DataError
        names the first missing one."""
        times = year_times(year)[:limit]
        for name, da in self.arrays.items():
            have = da.indexes["time"]
            index = have.get_indexer(times.astype("datetime64[ns]"))
            missing = times[index < 0]
            if len(missing) == len(times):
                span = f"{have[0]:%Y-%m-%d} to {have[-1]:%Y-%m-%d}" if len(have) else "nothing"
                raise DataError(f"{self.path} has no {name} in {year} (it covers {span})")
            inside = missing[(missing > have[0]) & (missing < have[-1])]
            if len(inside):
                more = f" (and {len(inside) - 1} more)" if len(inside) > 1 else ""
                raise DataError(f"{self.path} has a gap in time in {year}: no {name} at "
                                f"{inside[0]}{more}")
            if len(missing):
                raise DataError(f"{self.path} has {name} from {have[0]:%Y-%m-%dT%H} to "
                                f"{have[-1]:%Y-%m-%dT%H}: {len(missing)} of the "
                                f"{len(times)} 6-hourly times of {year} are outside it "
                                "(--max_samples N prepares only the first N of a year)")
            self._index[name] = index
        return times

    def read(self, start: int, stop: int) -> np.ndarray:
        """(stop - start, 20, H, W) float32: samples start .. stop - 1 of the selected year,
        rows from north to south, columns from 0 degrees east. One dask computation reads
        the 20 channels' pieces in parallel threads."""
        import dask

        lazy = [da.data[self._index[name][start:stop]]
                for name, da in self.arrays.items()]
        fields = np.stack(dask.compute(*lazy), axis=1).astype(np.float32, copy=False)
        if self._flip:
            fields = fields[:, :, ::-1]
        if self._reorder:  # longitudes from -180: columns from 0 degrees east
            fields = fields[..., self._columns]
        return np.ascontiguousarray(fields)


def year_times(year: int) -> np.ndarray:
    """Every 6-hourly time of a year from 00 UTC on 1 January: 1460, or 1464 in a leap year."""
    start = np.datetime64(f"{year}-01-01T00", "h")
    end = np.datetime64(f"{year + 1}-01-01T00", "h")
    return np.arange(start, end, 6 * HOUR)
