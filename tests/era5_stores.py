"""Small ERA5 sources made in the tests, in exactly the public layouts, from known fields.

    wb2_zarr(path, ...)   a WeatherBench-2 Zarr store: long names, `level` (hPa), 6-hourly,
                          `relative_humidity` a fraction; `latitude` descending with poles
                          (its 0.25 and 1.5 degree grids) or ascending without poles and
                          dimensions (time, level, longitude, latitude) (its coarse
                          equiangular grids: `coarse=True`); extra variables with and
                          without a time axis
    arco_zarr(path, ...)  an ARCO-ERA5 store: hourly, 37 levels, `specific_humidity` and no
                          relative humidity, `valid_time_start` / `valid_time_stop`
                          attributes and a time axis running past the stop (NaN there)
    cds_netcdf(dir, ...)  CDS downloads: single-level and pressure-level NetCDF files, short
                          names, `valid_time` + `pressure_level` (new CDS) or `time` +
                          `level` (older files), split by variable, level and/or month
    wb2_climatology(...)  a WeatherBench-2 climatology store: dayofyear x hour, every value
                          `clim_known(channel, day, hour, latitude, longitude)`

and `wb2_rule(forecast, truth)`, WeatherBench-2's alignment rule applied to two stores.

Every value is `known(channel, hours since 1970, latitude, longitude)` (relative humidity in
percent; the stores hold it as their convention has it), so a test can say which channel,
row, column and sample a number in the prepared files must be. The values are of ERA5's
magnitudes, so that relative humidity can be derived from the specific humidity the ARCO
store holds (`specific_humidity`, the inverse of the IFS formula, written out here).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data.era5_names import CHANNEL_NAMES, CHANNELS

EPOCH = np.datetime64("1970-01-01T00", "h")
HOUR = np.timedelta64(1, "h")
ARCO_LEVELS = (1, 2, 3, 5, 7, 10, 20, 30, 50, 70, 100, 125, 150, 175, 200, 225, 250, 300, 350,
               400, 450, 500, 550, 600, 650, 700, 750, 775, 800, 825, 850, 875, 900, 925, 950,
               975, 1000)
# A typical value of each kind of channel (units of data/era5_names.py).
_BASE = {"u": 2.0, "v": -1.0, "t": 262.0, "s": 98000.0, "m": 101000.0, "z": 50000.0,
         "r": 55.0}


def known(name: str, hours: np.ndarray, lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    """(T, H, W) float32 values of a channel: distinct per channel, row, column and time,
    with a daily and a yearly cycle (for the climatology)."""
    c = CHANNEL_NAMES.index(name)
    base = 30.0 if name == "tcwv" else 280.0 if name == "t2m" else _BASE[name[0]]
    t = np.asarray(hours, dtype=np.float64)[:, None, None]
    day = np.sin(2 * np.pi * t / 24.0)
    year = np.cos(2 * np.pi * t / (24.0 * 365.25))
    values = (base + c / 4.0 + np.asarray(lat)[None, :, None] / 8.0
              + np.asarray(lon)[None, None, :] / 64.0 + 2.0 * day + 3.0 * year
              + (t % 97.0) / 16.0)
    return values.astype(np.float32)


def specific_humidity(rh_percent: np.ndarray, t: np.ndarray, pressure_pa: float
                      ) -> np.ndarray:
    """q (kg/kg) with that relative humidity at temperature t and pressure p: the inverse of
    the IFS definition (saturation over water above 273.16 K, over ice below 250.16 K, a
    quadratic blend between), written out independently of data/humidity.py."""
    t = np.asarray(t, dtype=np.float64)
    water = 611.21 * np.exp(17.502 * (t - 273.16) / (t - 32.19))
    ice = 611.21 * np.exp(22.587 * (t - 273.16) / (t + 0.7))
    blend = np.where(t <= 250.16, 0.0, np.where(t >= 273.16, 1.0,
                                                ((t - 250.16) / 23.0) ** 2))
    e = np.asarray(rh_percent, dtype=np.float64) / 100.0 * (blend * water + (1 - blend) * ice)
    epsilon = 287.0597 / 461.5250
    return epsilon * e / (pressure_pa - (1.0 - epsilon) * e)


def grid(rows: int, cols: int, ascending: bool = False, poles: bool = True
         ) -> tuple[np.ndarray, np.ndarray]:
    """Latitudes (with both poles, or cell centres without) and longitudes from 0."""
    if poles:
        lat = np.linspace(90.0, -90.0, rows)
    else:
        step = 180.0 / rows
        lat = 90.0 - step / 2 - step * np.arange(rows)
    lon = 360.0 * np.arange(cols) / cols
    return (lat[::-1].copy() if ascending else lat), lon


def times(years: list[int], step_hours: int, days: int | None = None) -> np.ndarray:
    """Every `step_hours` from 00 UTC on 1 January of each year, all year or `days` days."""
    out = []
    for y in years:
        start = np.datetime64(f"{y}-01-01T00", "h")
        end = (start + days * 24 * HOUR) if days else np.datetime64(f"{y + 1}-01-01T00", "h")
        out.append(np.arange(start, end, step_hours * HOUR))
    return np.concatenate(out)


def _variables(when: np.ndarray, lat: np.ndarray, lon: np.ndarray, short: bool,
               humidity: str, skip: tuple[str, ...] = (), levels: tuple[int, ...] = ()
               ) -> tuple[dict, dict, list[int]]:
    """{name: (dims, values, attrs)} of the single-level and the pressure-level variables;
    relative humidity as `humidity` says: "percent" (CDS `r`), "fraction" (WeatherBench-2)
    or "specific" (ARCO: `specific_humidity` in its place)."""
    hours = (when - EPOCH).astype(np.int64)
    levels = sorted(set(levels) | {c.level for c in CHANNELS if c.level is not None})
    single, pressure = {}, {}
    for c in CHANNELS:
        if c.name in skip:
            continue
        name, units = c.short if short else c.variable, c.units
        values = known(c.name, hours, lat, lon)
        if c.variable == "relative_humidity" and humidity == "fraction":
            values, units = values / np.float32(100), "1"
        elif c.variable == "relative_humidity" and humidity == "specific":
            t = known(f"t{c.level}", hours, lat, lon)
            values = specific_humidity(values, t, 100.0 * c.level).astype(np.float32)
            name, units = ("q" if short else "specific_humidity"), "kg kg**-1"
        attrs = {"units": units, "long_name": name.replace("_", " ")}
        if c.level is None:
            single[name] = (("time", "latitude", "longitude"), values, attrs)
            continue
        if name not in pressure:
            pressure[name] = (("time", "level", "latitude", "longitude"),
                              np.full((len(when), len(levels), len(lat), len(lon)), np.nan,
                                      dtype=np.float32), attrs)
        pressure[name][1][:, levels.index(c.level)] = values
    for name, (_, values, _) in pressure.items():  # levels no channel needs: finite values
        for i, level in enumerate(levels):
            if np.isnan(values[:, i]).all():
                values[:, i] = 1e-4 * level if name in ("q", "specific_humidity") else level
    return single, pressure, levels


def _write_zarr(path: Path, ds, chunk_time: int) -> Path:
    chunks = {d: (chunk_time if d == "time" else n) for d, n in ds.sizes.items()}
    ds = ds.chunk(chunks)
    for name in ds.variables:  # coordinates without a fill value, as the public stores
        ds[name].encoding["_FillValue"] = None if name in ds.coords else np.nan
    ds.to_zarr(path, mode="w", zarr_format=2, consolidated=True)
    return path


def wb2_zarr(path: Path, years: list[int], rows: int = 7, cols: int = 12,
             step_hours: int = 6, days: int | None = None, coarse: bool = False,
             skip: tuple[str, ...] = (), drop_times: int = 0, chunk_time: int = 24,
             humidity: str = "fraction", with_q: bool = False) -> Path:
    """A WeatherBench-2 style store (module docstring); `coarse` gives the layout of its
    coarse equiangular grids (ascending without poles, longitude before latitude); `skip`
    leaves channels out (a single-level variable, or a level of a pressure-level one),
    `drop_times` removes that many times from the middle (a gap); `with_q` adds
    `specific_humidity`, such that ECMWF's relative humidity of it is the known one (the
    store's `relative_humidity` holds the known values too). The public stores chunk one
    time per chunk; `chunk_time` times per chunk keep the tests' small stores quick."""
    import xarray as xr

    lat, lon = grid(rows, cols, ascending=coarse, poles=not coarse)
    when = times(years, step_hours, days)
    if drop_times:
        mid = len(when) // 2
        when = np.delete(when, np.arange(mid, mid + drop_times))
    single, pressure, levels = _variables(when, lat, lon, False, humidity, skip,
                                          levels=(100, 700, 925))
    if with_q:
        q = _variables(when, lat, lon, False, "specific", skip, levels=(100, 700, 925))[1]
        pressure["specific_humidity"] = q["specific_humidity"]
    hours = (when - EPOCH).astype(np.int64)
    extra = {  # variables no channel needs, with and without a time axis
        "total_precipitation_6hr": (("time", "latitude", "longitude"),
                                    np.zeros((len(when), rows, cols), np.float32)),
        "land_sea_mask": (("latitude", "longitude"), np.ones((rows, cols), np.float32)),
        "geopotential_at_surface": (("latitude", "longitude"),
                                    known("z1000", hours[:1], lat, lon)[0])}
    ds = xr.Dataset({**single, **pressure, **extra}, coords={
        "time": when.astype("datetime64[ns]"),
        "level": ("level", np.asarray(levels, dtype=np.int64), {"units": "millibars"}),
        "latitude": ("latitude", lat.astype(np.float32), {"units": "degrees_north"}),
        "longitude": ("longitude", lon.astype(np.float32), {"units": "degrees_east"}),
    })
    if any(c.level is not None and c.name in skip for c in CHANNELS):
        # a level missing from the store: keep only the levels every variable has
        ds = ds.sel(level=[lv for lv in levels
                           if not any(c.level == lv and c.name in skip for c in CHANNELS)])
    if coarse:
        ds = ds.transpose(..., "longitude", "latitude")
    return _write_zarr(path, ds, chunk_time)


def arco_zarr(path: Path, years: list[int], days: int, stop_day: int | None = None,
              rows: int = 7, cols: int = 12) -> Path:
    """An ARCO-ERA5 style store (module docstring): hourly, `days` days of each year;
    `valid_time_stop` after `stop_day` days of the last year (None: the last day), the
    times after it NaN."""
    import xarray as xr

    lat, lon = grid(rows, cols)
    when = times(years, 1, days)
    single, pressure, levels = _variables(when, lat, lon, False, "specific",
                                          levels=ARCO_LEVELS)
    stop = np.datetime64(f"{years[-1]}-01-01", "D") + (days if stop_day is None
                                                        else stop_day) - 1
    after = when >= (stop + 1).astype("datetime64[h]")
    for _, values, _ in (*single.values(), *pressure.values()):
        values[after] = np.nan
    ds = xr.Dataset({**single, **pressure}, coords={
        "time": when.astype("datetime64[ns]"),
        "level": ("level", np.asarray(levels, dtype=np.int64), {"units": "millibars"}),
        "latitude": ("latitude", lat.astype(np.float32), {"units": "degrees_north"}),
        "longitude": ("longitude", lon.astype(np.float32), {"units": "degrees_east"}),
    }, attrs={"valid_time_start": f"{years[0]}-01-01", "valid_time_stop": str(stop)})
    return _write_zarr(path, ds, chunk_time=48)


def cds_netcdf(directory: Path, years: list[int], rows: int = 7, cols: int = 12,
               new_names: bool = True, pressure_rows: int | None = None,
               split: tuple[str, ...] = (), months: int = 12) -> Path:
    """CDS-style NetCDF files, 6-hourly, the first `months` months of each year (module
    docstring): one single-level and one pressure-level file per year, or split further by
    "variable", "level" and/or "month" (`split`); `pressure_rows` puts the pressure-level
    files on another grid."""
    import xarray as xr

    directory.mkdir(parents=True, exist_ok=True)
    time_name, level_name = ("valid_time", "pressure_level") if new_names else ("time", "level")
    for year in years:
        when = times([year], 6)
        when = when[when < np.datetime64(f"{year}-{months + 1:02d}-01" if months < 12 else
                                         f"{year + 1}-01-01", "h")]
        for kind, n_rows in (("single", rows), ("pressure", pressure_rows or rows)):
            lat, lon = grid(n_rows, cols)
            single, pressure, levels = _variables(when, lat, lon, True, "percent")
            data = single if kind == "single" else pressure
            coords = {"time": when.astype("datetime64[ns]"),
                      "latitude": ("latitude", lat, {"units": "degrees_north"}),
                      "longitude": ("longitude", lon, {"units": "degrees_east"})}
            if kind == "pressure":
                coords["level"] = ("level", np.asarray(levels, dtype=np.float64),
                                   {"units": "hPa"})
            ds = xr.Dataset(data, coords=coords)
            for part, piece in _split(ds, split, kind, months):
                piece = piece.rename({k: v for k, v in (("time", time_name),
                                                        ("level", level_name))
                                      if k in piece.coords})
                if new_names:
                    n = piece.sizes[time_name]
                    piece = piece.assign_coords(number=0, expver=(time_name, ["0001"] * n))
                piece.to_netcdf(directory / f"era5_{kind}_{year}{part}.nc")
    return directory


def _split(ds, split: tuple[str, ...], kind: str, months: int):
    """(file name suffix, dataset) of each file `ds` is split into."""
    parts = [("", ds)]
    if "variable" in split:
        parts = [(f"{s}_{v}", d[[v]]) for s, d in parts for v in d.data_vars]
    if "level" in split and kind == "pressure":
        parts = [(f"{s}_{int(lv)}", d.sel(level=[lv])) for s, d in parts
                 for lv in d.level.values]
    if "month" in split:
        parts = [(f"{s}_{m:02d}", d.sel(time=d.time.dt.month == m)) for s, d in parts
                 for m in range(1, months + 1)]
    return parts


def poke(store: Path, variable: str, index: tuple, value: float) -> None:
    """Set one value of a variable (or a coordinate) of a Zarr store written here."""
    import zarr

    array = zarr.open_group(str(store), mode="r+")[variable]
    array[index] = value


def clim_known(name: str, day: np.ndarray, hour: np.ndarray, lat: np.ndarray,
               lon: np.ndarray) -> np.ndarray:
    """(..., H, W) float32 climatology of a channel (percent for relative humidity; ws10:
    10 m wind speed) at days of year and hours: distinct per channel, day, hour and place."""
    c = (CHANNEL_NAMES + ("ws10",)).index(name)
    day = np.asarray(day, dtype=np.float64)[..., None, None]
    hour = np.asarray(hour, dtype=np.float64)[..., None, None]
    base = 30.0 if name == "tcwv" else 280.0 if name == "t2m" else 5.0 if name == "ws10" \
        else _BASE[name[0]]
    values = (base + c / 3.0 + np.cos(2 * np.pi * day / 366.0) + hour / 24.0
              + np.asarray(lat)[:, None] / 16.0 + np.asarray(lon)[None, :] / 128.0)
    return values.astype(np.float32)


def wb2_climatology(path: Path, lat: np.ndarray, lon: np.ndarray,
                    hours: tuple[int, ...] = (0, 6, 12, 18), chunked: bool = False,
                    rh_units: str | None = "1", channels: tuple[str, ...] | None = None
                    ) -> Path:
    """A climatology store in WeatherBench-2's layout (dayofyear 1 .. 366 x hour, its
    variable names and units: relative humidity a fraction (`rh_units` None: without a
    units attribute); 10m_wind_speed; dimensions in its order, hour first), every value
    `clim_known`; `chunked`: its 0.25-degree store's chunks (3 hours x 3 days x one level
    x the grid), else one chunk a variable; `channels`: only theirs (and ws10)."""
    import xarray as xr

    day, hour = np.arange(1, 367), np.asarray(hours)
    dd, hh = np.meshgrid(day, hour, indexing="ij")
    kept = [c for c in CHANNELS if channels is None or c.name in channels]
    levels = sorted({c.level for c in kept if c.level is not None} | {700})
    data = {}
    for c in (*kept, None):
        name, variable, units = ("ws10", "10m_wind_speed", "m s**-1") if c is None else (
            c.name, c.variable, c.units)
        values = clim_known(name, dd, hh, lat, lon)  # (day, hour, H, W)
        if variable == "relative_humidity":
            values, units = values / np.float32(100), rh_units
        if c is None or c.level is None:
            data[variable] = (("dayofyear", "hour", "latitude", "longitude"), values,
                              {"units": units})
            continue
        if variable not in data:
            data[variable] = (("dayofyear", "hour", "level", "latitude", "longitude"),
                              np.zeros((len(day), len(hour), len(levels), len(lat), len(lon)),
                                       np.float32), {"units": units})
        data[variable][1][:, :, levels.index(c.level)] = values
    ds = xr.Dataset(data, coords={
        "dayofyear": day, "hour": hour, "level": np.asarray(levels, dtype=np.int64),
        "latitude": ("latitude", np.asarray(lat, np.float64)),
        "longitude": ("longitude", np.asarray(lon, np.float64))})
    ds = ds.transpose("hour", "dayofyear", ...)
    for name in ds.data_vars:
        if ds[name].attrs.get("units") is None:
            del ds[name].attrs["units"]
    sizes = {"hour": 3, "dayofyear": 3, "level": 1}
    encoding = {name: {"chunks": tuple(sizes.get(d, ds.sizes[d]) for d in ds[name].dims)}
                for name in ds.data_vars} if chunked else None
    ds.to_zarr(path, mode="w", zarr_format=2, consolidated=True, encoding=encoding)
    return path


LEVELS = [500, 850]  # the levels every pressure-level variable of the 20 channels has
VARIABLES = ["geopotential", "temperature", "relative_humidity", "2m_temperature",
             "10m_u_component_of_wind"]


def wb2_rule(forecast, truth, levels=LEVELS, variables=VARIABLES):
    """WeatherBench-2's evaluation of a forecast store against a truth store, up to its
    selection, written out: latitude made increasing in both, the forecast's latitude and
    longitude equal to the truth's to 1e-3 before anything is selected (its
    `open_source_files`), then the variables and levels asked for (`_impose_data_selection`).
    Returns (forecast, truth), or raises an AssertionError / KeyError where it stops."""
    def increasing(ds):
        lat = ds.latitude.values
        return ds.isel(latitude=slice(None, None, -1)) if (np.diff(lat) < 0).all() else ds

    forecast, truth = increasing(forecast), increasing(truth)
    for name in ("latitude", "longitude"):
        np.testing.assert_allclose(forecast[name].values, truth[name].values, atol=1e-3)
    forecast = forecast.assign_coords(latitude=truth.latitude, longitude=truth.longitude)
    return (forecast[variables].sel(level=levels), truth[variables].sel(level=levels))
