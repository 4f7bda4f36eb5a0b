"""Opening an ERA5 source: a Zarr store (a local path or a URL) or CDS NetCDF files.

Every dataset is opened lazily without dask (xarray's lazily indexed arrays: nothing is read
until a batch asks for its times) and cut to the times asked for before anything else looks
at it, so the cost of opening does not grow with the length of the store's time axis
(WeatherBench-2's stores hold 93,544 six-hourly times, ARCO-ERA5's hourly axis runs past
2050). A store's `valid_time_start` / `valid_time_stop` attributes (ARCO-ERA5: its time axis
is allocated beyond the data, which reads as NaN there) bound the times it is taken to have.

URLs are read through fsspec: `gs://` anonymously with gcsfs (installed by requirements.txt),
`http(s)://` with aiohttp. Each way opening can fail is one DataError line: a missing package,
a host that cannot be reached, a path where there is no store, a file that is not NetCDF.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from utils.errors import DataError

_RENAME = {"valid_time": "time", "pressure_level": "level", "lat": "latitude",
           "lon": "longitude", "isobaricInhPa": "level"}
HOUR = np.timedelta64(1, "h")
EPOCH = np.datetime64("1970-01-01T00", "h")


@dataclass(frozen=True)
class Opened:
    """One dataset of a source, cut to the times asked for."""

    where: str        # the store or file
    dataset: Any      # xarray.Dataset, lazily indexed
    hours: np.ndarray  # int64 hours since 1970-01-01 of its (cut) time axis
    span: tuple[int, int]  # the first and last of its whole time axis (hours)
    limit: str = ""   # why the axis ends early: "its valid_time_stop 2025-12-31", or ""


def is_url(path: str) -> bool:
    return "://" in path


def _is_zarr(path: str) -> bool:
    if is_url(path):
        return True
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m))
                                       for m in (".zgroup", ".zmetadata", "zarr.json"))


def _explain(path: str, e: BaseException) -> DataError:
    """The one line for an exception raised while opening `path`."""
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, ImportError):
        protocol = path.split("://")[0] if is_url(path) else "this source"
        package = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "http": "aiohttp",
                   "https": "aiohttp"}.get(protocol, "the package fsspec names")
        return DataError(f"reading {path} needs the {package} package, which is not "
                         f"installed (pip install -r requirements.txt): {first}")
    if _unreachable(e):
        host = path.split("://")[1].split("/")[0] if is_url(path) else path
        return DataError(f"cannot reach {host} to read {path} ({first}); check the "
                         "network, or copy the store to a local disk first")
    if isinstance(e, (FileNotFoundError, KeyError)) or "not found" in first.lower():
        return DataError(f"{path}: no Zarr store there ({first}); check the path (the "
                         "public stores are listed in docs/real_era5.md)")
    if isinstance(e, PermissionError) or "403" in first or "forbidden" in first.lower():
        return DataError(f"{path}: access denied ({first}); the public buckets are read "
                         "anonymously, a private one needs credentials")
    return DataError(f"cannot open {path} as a Zarr store or NetCDF files ({first})")


def _unreachable(e: BaseException) -> bool:
    """A connection that failed (no route, no name, refused, timed out), in any wrapping."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        name = type(e).__name__
        if isinstance(e, (ConnectionError, TimeoutError)) or name in (
                "ClientConnectorError", "ClientConnectorDNSError", "ServerTimeoutError",
                "ClientConnectionError", "ConnectTimeout", "gaierror"):
            return True
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return False


def _open_files(path: str) -> list[tuple[str, Any]]:
    """[(where, xarray.Dataset)]: the store, or every NetCDF file of the directory."""
    import xarray as xr

    if _is_zarr(path):
        # The public buckets are read anonymously.
        options = {"token": "anon"} if path.startswith(("gs://", "gcs://")) else None
        return [(path, xr.open_dataset(path, engine="zarr", chunks=None, cache=False,
                                       storage_options=options))]
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        files = sorted(f for ext in ("nc", "nc4", "netcdf")
                       for f in glob.glob(os.path.join(path, f"*.{ext}")))
        if not files:
            raise DataError(f"{path}: no Zarr store and no NetCDF files (*.nc) in it")
    else:
        raise DataError(f"source {path} does not exist")
    return [(f, xr.open_dataset(f, chunks=None, cache=False)) for f in files]


def _normalised(ds: Any) -> Any:
    """The dataset with the public stores' names for time, level, latitude and longitude,
    and singleton dimensions (ensemble member `number`, `expver`) dropped."""
    ds = ds.rename({k: v for k, v in _RENAME.items() if k in ds.variables})
    for name in ("number", "expver"):
        if name in ds.dims and ds.sizes[name] == 1:
            ds = ds.isel({name: 0})
    return ds


def _valid_span(ds: Any) -> tuple[np.datetime64 | None, np.datetime64 | None, str]:
    """(first, end (exclusive), note) from `valid_time_start` / `valid_time_stop`; a date
    without an hour covers that whole day."""
    bounds = []
    for key, after in (("valid_time_start", False), ("valid_time_stop", True)):
        text = ds.attrs.get(key)
        if not text:
            bounds.append(None)
            continue
        try:
            when = np.datetime64(str(text).strip().replace(" ", "T"))
        except ValueError:
            raise DataError(f"attribute {key} = '{text}' is not a date") from None
        whole_day = when.dtype == np.dtype("datetime64[D]")
        when = when.astype("datetime64[h]")
        bounds.append(when + 24 * HOUR if after and whole_day else
                      when + HOUR if after else when)
    stop = ds.attrs.get("valid_time_stop")
    return bounds[0], bounds[1], f"its valid_time_stop {stop}" if stop else ""


def _cut(where: str, ds: Any, first: np.datetime64, end: np.datetime64) -> Opened:
    """`ds` cut to times in [first, end) and to its valid span: a searchsorted on a sorted
    axis (a mask otherwise), never a sort of the whole axis."""
    times = np.asarray(ds.indexes["time"].values)
    if np.isnat(times).any():
        raise DataError(f"{where}: coordinate time has {int(np.isnat(times).sum())} missing "
                        "value(s) (NaT)")
    hours = ((times.astype("datetime64[h]") - EPOCH) / HOUR).astype(np.int64)
    start, stop, note = _valid_span(ds)
    lo = (max(first, start) if start is not None else first) - EPOCH
    hi = (min(end, stop) if stop is not None else end) - EPOCH
    lo, hi = int(lo / HOUR), int(hi / HOUR)
    limit = note if stop is not None and stop < end else ""
    if len(hours) < 2 or (np.diff(hours) > 0).all():
        a, b = np.searchsorted(hours, [lo, hi])
        keep: Any = slice(int(a), int(b))
    else:
        keep = np.flatnonzero((hours >= lo) & (hours < hi))
    span = (int(hours.min()), int(hours.max())) if len(hours) else (0, -1)
    return Opened(where, ds.isel(time=keep), hours[keep], span, limit)


def open_source(path: str, first: np.datetime64, end: np.datetime64) -> list[Opened]:
    """Every dataset of the source at `path`, cut to the times in [first, end) (hours)."""
    try:
        files = _open_files(path)
    except DataError:
        raise
    except Exception as e:  # whatever fsspec, zarr or netCDF4 raise: one line
        raise _explain(path, e) from None
    opened = []
    for where, ds in files:
        ds = _normalised(ds)
        if "time" not in ds.indexes:  # e.g. a land-sea mask file: no channel needs it
            continue
        opened.append(_cut(where, ds, first, end))
    return opened


def coordinate(ds: Any, name: str, where: str) -> np.ndarray:
    """A 1-D coordinate (latitude, longitude, level) as float64; a missing value in it is a
    DataError naming the coordinate."""
    if name not in ds.coords:
        raise DataError(f"{where} has no {name} coordinate")
    values = np.asarray(ds[name].values, dtype=np.float64).reshape(-1)
    bad = np.flatnonzero(~np.isfinite(values))
    if len(bad):
        raise DataError(f"{where}: coordinate {name} has {len(bad)} missing value(s) "
                        f"(NaN), the first at index {bad[0]} of {len(values)}")
    return values
