"""WeatherBench-2's climatology store as the anomaly reference of ACC and the climatology
baseline (`inference.py --climatology PATH`), so that both are measured against its
climatology instead of the data set's harmonic fit (data/climatology.py; docs/scoring.md
says how the two differ).

The store's layout, as WeatherBench-2's climatologies (its data guide: `era5-hourly-
climatology/1990-2019_6h_<grid>.zarr`) hold it: each variable under its WeatherBench-2 name
(or the name with `_mean`), on dimensions `dayofyear` (1 .. 366) and `hour` (0 .. 23, or
every 6 h), `latitude`, `longitude` and, on pressure levels, `level` (hPa), in any order; in
its units (relative humidity a fraction). A forecast valid at time t is compared with the
entry at t's day of year and hour of day, as its evaluation selects it. The store's rows and
columns are matched by coordinate to the grid scored, to WeatherBench-2's tolerance of 1e-3
degrees: the same grid or a crop of it; a grid it does not contain (block means) is refused.
"""

from __future__ import annotations

import numpy as np

from data.era5_names import channel, humidity_scale, wb2_units
from data.grid import Grid
from utils.errors import DataError

TOLERANCE = 1e-3  # degrees, WeatherBench-2's `_ensure_aligned_grid`
EPOCH = np.datetime64("1970-01-01T00", "h")


def _match(have: np.ndarray, want: np.ndarray, name: str, path: str) -> np.ndarray:
    """Indices into `have` of each value of `want` (to TOLERANCE), else a DataError."""
    have360, want360 = (np.mod(x, 360.0) if name == "longitude" else x for x in (have, want))
    distance = np.abs(have360[None, :] - want360[:, None])
    index = distance.argmin(axis=1)
    far = distance[np.arange(len(want)), index] > TOLERANCE
    if far.any():
        raise DataError(f"{path}: its {name} ({len(have)} values, {have.min():g} .. "
                        f"{have.max():g}) has no {want[far][0]:g}, a {name} of the grid "
                        f"scored ({len(want)} values); use the climatology of the grid the "
                        "data was prepared on (a crop of it works, block means do not)")
    return index


def day_and_hour(hours: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(day of year 1 .. 366, hour of day) of times in hours since 1970-01-01."""
    when = EPOCH + np.asarray(hours, dtype=np.int64) * np.timedelta64(1, "h")
    day = when.astype("datetime64[D]")
    jan1 = day.astype("datetime64[Y]").astype("datetime64[D]")
    return ((day - jan1).astype(np.int64) + 1,
            ((when - day.astype("datetime64[h]")) / np.timedelta64(1, "h")).astype(np.int64))


class StoreClimatology:
    """The climatology of `channels` on `grid` (rows north to south), read from a
    WeatherBench-2 climatology store a (day of year, hour) at a time, in the prepared
    files' units."""

    def __init__(self, path: str, channels: list[str], grid: Grid):
        import xarray as xr

        self.path, self.channels = path, list(channels)
        try:
            ds = xr.open_dataset(path, engine="zarr", chunks=None, cache=False)
        except Exception as e:  # a path with no store, a file that is not Zarr: one line
            raise DataError(f"--climatology {path}: not a Zarr store "
                            f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                            ) from None
        for dim in ("dayofyear", "hour", "latitude", "longitude"):
            if dim not in ds.coords:
                raise DataError(f"--climatology {path} has no '{dim}' coordinate: not a "
                                "WeatherBench-2 climatology (dayofyear x hour)")
        self._days = np.asarray(ds["dayofyear"].values, dtype=np.int64)
        self._hours = np.asarray(ds["hour"].values, dtype=np.int64)
        self._rows = _match(np.asarray(ds["latitude"].values, np.float64), grid.latitude,
                            "latitude", path)
        self._cols = _match(np.asarray(ds["longitude"].values, np.float64), grid.longitude,
                            "longitude", path)
        self._arrays = [self._array(ds, name) for name in self.channels]
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def _array(self, ds, name: str) -> tuple[object, float]:
        """(the channel's DataArray at its level, dims ordered latitude, longitude last;
        the factor to the prepared files' units)."""
        c = channel(name)
        if c is None:
            raise DataError(f"--climatology {self.path}: channel {name} has no "
                            "WeatherBench-2 name (data/era5_names.py)")
        variable = next((v for v in (c.variable, f"{c.variable}_mean") if v in ds), None)
        if variable is None:
            raise DataError(f"--climatology {self.path} lacks '{c.variable}' (channel "
                            f"{name}); it has {', '.join(sorted(map(str, ds.data_vars)))}")
        da = ds[variable]
        if c.level is not None:
            levels = np.asarray(ds["level"].values, dtype=np.float64) if "level" in ds.coords \
                else np.zeros(0)
            hit = np.flatnonzero(np.isclose(levels, c.level))
            if not len(hit):
                raise DataError(f"--climatology {self.path} has no '{variable}' at {c.level} "
                                f"hPa (channel {name})")
            da = da.isel(level=int(hit[0]))
        if c.variable == "relative_humidity":  # to percent, by its units attribute
            factor = humidity_scale(variable, da.attrs.get("units"), self.path)
        else:
            factor = 1.0 / wb2_units(c.variable)[1]
        return da.transpose("dayofyear", "hour", "latitude", "longitude"), factor

    def _at(self, day: int, hour: int) -> np.ndarray:
        """(C, H, W) float32 at one day of year and hour (cached)."""
        if (day, hour) not in self._cache:
            i = np.flatnonzero(self._days == day)
            j = np.flatnonzero(self._hours == hour)
            if not len(i) or not len(j):
                raise DataError(f"--climatology {self.path} has no entry for day of year "
                                f"{day} at {hour} h (hours {self._hours.tolist()})")
            planes = []
            for da, factor in self._arrays:
                plane = np.asarray(da.isel(dayofyear=int(i[0]), hour=int(j[0])).values,
                                   dtype=np.float64)
                planes.append(plane[np.ix_(self._rows, self._cols)] * factor)
            self._cache[(day, hour)] = np.stack(planes).astype(np.float32)
        return self._cache[(day, hour)]

    def at(self, hours: np.ndarray) -> np.ndarray:
        """(..., C, H, W) float32: the climatology at each valid time (hours since 1970)."""
        hours = np.asarray(hours, dtype=np.int64)
        days, hour = day_and_hour(hours.reshape(-1))
        fields = np.stack([self._at(int(d), int(h)) for d, h in zip(days, hour, strict=True)])
        return fields.reshape(*hours.shape, *fields.shape[1:])
