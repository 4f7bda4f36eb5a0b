"""Opening an ERA5 source: a Zarr store (a local path or a URL) or CDS NetCDF files.

Every dataset is opened lazily without dask (xarray's lazily indexed arrays: nothing is read
until a batch asks for its times) and cut to the times asked for before anything else looks
at it, so the cost of opening does not grow with the length of the store's time axis
(WeatherBench-2's stores hold 93,544 six-hourly times, ARCO-ERA5's hourly axis runs past
2050). A store's `valid_time_start` / `valid_time_stop` attributes (ARCO-ERA5: its time axis
is allocated beyond the data, which reads as NaN there) bound the times it is taken to have.

URLs are read through fsspec: `gs://` anonymously with gcsfs (installed by requirements.txt),
`http(s)://` with aiohttp. Each way opening can fail is one DataError line: a missing package,
a host that cannot be reached, a path where there is no store, a file that is not NetCDF
(each file is opened on its own, so the line names it).

CDS downloads are taken as they arrive:
  - a zip (the new CDS packs a request that mixes step types, or asks for `download_format:
    zip`, into one, whatever the file is named): its NetCDF files are extracted once beside
    it as `<zip name>_<member>` (said on stderr) and read like the others;
  - time as `valid_time` (new CDS) or `time` (older); a cfgrib conversion has both, `time`
    then being the forecast's reference time and `valid_time` the time of the field: the
    valid time is taken (variables with a `step` axis of several steps, accumulations, are
    no channel and are left out);
  - `expver` (ERA5 = 1, ERA5T = 5 in the latest months) as a dimension of two: each time is
    taken from the experiment that holds it (ERA5 first);
  - a pressure-level variable without a level dimension (the old CDS dropped a single
    level): its level from a scalar level coordinate, its attributes or the file name
    (`..._500hPa.nc`, `..._500_...`); in a file of single-level variables (or marked as a
    surface field) it is a surface field with a pressure-level name (the orography `z`)
    and is kept apart, used for no channel; anything else is refused in one line naming the
    file.
"""

from __future__ import annotations

import glob
import os
import re
import sys
import zipfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from data.era5_names import CHANNELS
from utils.errors import DataError

_RENAME = {"valid_time": "time", "pressure_level": "level", "lat": "latitude",
           "lon": "longitude", "isobaricInhPa": "level"}
EXTENSIONS = ("nc", "nc4", "netcdf", "zip")
ZARR_BATCH = 32  # chunks Zarr decodes together (its codec_pipeline.batch_size; default 1)
# Names of the variables on pressure levels (the channels' and specific humidity, from which
# relative humidity can be derived), and of the single-level ones.
PRESSURE_NAMES = {n for c in CHANNELS if c.level is not None for n in (c.variable, c.short)
                  } | {"specific_humidity", "q"}
SINGLE_NAMES = {n for c in CHANNELS if c.level is None for n in (c.variable, c.short)}
# The levels the channels need: a bare number in a file name is one of these.
NEEDED_LEVELS = sorted({c.level for c in CHANNELS if c.level is not None})
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
    # Pressure-level variables without a level dimension: the level each one is at, and the
    # surface fields with pressure-level names (kept apart, for no channel).
    level_of: dict[str, float] = field(default_factory=dict)
    apart: tuple[str, ...] = ()


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
    """[(where, xarray.Dataset)]: the store, or every NetCDF file of the directory (the
    members of each zip among them extracted beside it)."""
    import xarray as xr

    if _is_zarr(path):
        import zarr

        # A request's chunks decoded in batches, not one by one: ~30 % less CPU per chunk
        # (a batch of 32 times of a 5.625-degree variable: 52 ms against 72 ms for 11
        # variables, docs/real_era5.md). Process-wide: Zarr's configuration is global.
        zarr.config.set({"codec_pipeline.batch_size": ZARR_BATCH})
        # The public buckets are read anonymously.
        options = {"token": "anon"} if path.startswith(("gs://", "gcs://")) else None
        return [(path, xr.open_dataset(path, engine="zarr", chunks=None, cache=False,
                                       storage_options=options))]
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        files = sorted(f for ext in EXTENSIONS
                       for f in glob.glob(os.path.join(path, f"*.{ext}")))
        if not files:
            raise DataError(f"{path}: no Zarr store and no NetCDF files (*.nc) in it")
    else:
        raise DataError(f"source {path} does not exist")
    zips = [f for f in files if zipfile.is_zipfile(f)]
    members = [m for z in zips for m in unzipped(z)]
    files = sorted({*(f for f in files if f not in zips), *members})
    return [(f, open_netcdf(f)) for f in files]


def open_netcdf(path: str) -> Any:
    """One NetCDF file, lazily; anything else is a DataError naming it."""
    import xarray as xr

    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None
    if magic == b"GRIB":
        raise DataError(f"{path} is a GRIB file, not NetCDF: ask the CDS for NetCDF "
                        "(format 'netcdf'), or convert it first (xarray's cfgrib engine)")
    try:
        return xr.open_dataset(path, chunks=None, cache=False)
    except Exception as e:  # netCDF4's or xarray's, whatever the cause: one line naming it
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{path}: not a NetCDF file xarray can open ({first})") from None


def unzipped(path: str) -> list[str]:
    """The files of a zip archive, extracted once beside it as `<its name>_<member>` (a
    file already there with the member's size is taken as it is); their paths."""
    where = os.path.dirname(os.path.abspath(path))
    stem = os.path.splitext(os.path.basename(path))[0]
    out, extracted = [], []
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.is_dir():
                    continue
                target = os.path.join(where, f"{stem}_{os.path.basename(info.filename)}")
                out.append(target)
                if os.path.isfile(target) and os.path.getsize(target) == info.file_size:
                    continue
                tmp = f"{target}.partial"
                with z.open(info) as src, open(tmp, "wb") as dst:
                    while block := src.read(1 << 24):
                        dst.write(block)
                os.replace(tmp, target)
                extracted.append(os.path.basename(target))
    except (OSError, zipfile.BadZipFile) as e:
        raise DataError(f"{path} is a zip archive that could not be extracted beside it "
                        f"({getattr(e, 'strerror', None) or e}); unzip it into a "
                        "directory you can write and give that directory") from None
    if extracted:
        print(f"{path} is a zip archive: extracted {', '.join(extracted)} beside it",
              file=sys.stderr)
    return out


def _normalised(where: str, ds: Any) -> tuple[Any, dict[str, float], tuple[str, ...]]:
    """(the dataset with the public stores' names for time, level, latitude and longitude
    and singleton dimensions (ensemble member `number`, a single `expver`) dropped; the
    level of each pressure-level variable without a level dimension; the surface fields
    with pressure-level names, left out of the dataset)."""
    if "valid_time" in ds.variables and "time" in ds.variables:
        ds = _on_valid_time(ds)
    ds = ds.rename({k: v for k, v in _RENAME.items() if k in ds.variables})
    for name in ("number", "expver"):
        if name in ds.dims and ds.sizes[name] == 1:
            ds = ds.isel({name: 0})
    level_of: dict[str, float] = {}
    apart = []
    for name in [str(n) for n in ds.data_vars]:
        da = ds[name]
        if name not in PRESSURE_NAMES or "level" in da.dims or "time" not in da.dims:
            continue
        level = _level_of(where, ds, da)
        if level is not None:
            level_of[name] = level
        elif _is_surface(where, ds, da):
            apart.append(name)
        else:
            raise DataError(
                f"{where}: '{name}' has no level dimension and neither the file's name nor "
                f"its attributes give one: if it is one pressure level, put the level in "
                f"the file name (e.g. {_with_level(where)}); if it is a surface field, it "
                "is not needed here: move the file away")
    if "level" in ds.variables and ds["level"].ndim == 0:
        ds = ds.drop_vars("level")
    return ds.drop_vars(apart), level_of, tuple(apart)


def _on_valid_time(ds: Any) -> Any:
    """A cfgrib conversion (`time` the reference time, `valid_time` the field's) on the
    valid time; variables over several steps (accumulations: no channel) left out."""
    steps = [n for n in ds.data_vars if "step" in ds[n].dims and ds.sizes["step"] > 1]
    ds = ds.drop_vars(steps)
    if "step" in ds.dims:
        ds = ds.isel(step=0)
    ds = ds.rename({"time": "reference_time"})
    if ds["valid_time"].ndim == 0:
        return ds.expand_dims("valid_time")
    return ds.swap_dims({ds["valid_time"].dims[0]: "valid_time"})


def _level_of(where: str, ds: Any, da: Any) -> float | None:
    """The pressure level (hPa) of a variable without a level dimension: a scalar level
    coordinate, a level attribute, else a level in the file name; None if none."""
    if "level" in ds.variables and ds["level"].ndim == 0:
        return float(ds["level"].values)
    for key in ("level", "pressure_level", "GRIB_level"):
        value = da.attrs.get(key, ds.attrs.get(key))
        if value is not None and str(value).strip().replace(".", "", 1).isdigit():
            return float(value)
    name = os.path.splitext(os.path.basename(where))[0]
    marked = {float(m) for m in re.findall(r"(?<![0-9])(\d{1,4})\s*(?:hpa|mb|mbar)(?![a-z])",
                                           name, flags=re.IGNORECASE)}
    bare = {float(t) for t in re.split(r"[^0-9]+", name)
            if t and not t.startswith("0") and int(t) in NEEDED_LEVELS}
    found = marked or bare
    if len(found) > 1:
        raise DataError(f"{where}: its name has several pressure levels "
                        f"({', '.join(f'{v:g}' for v in sorted(found))}) and "
                        f"'{da.name}' has no level dimension: name the file by its one level")
    return found.pop() if found else None


def _is_surface(where: str, ds: Any, da: Any) -> bool:
    """Whether a variable without a level is a surface field: marked so, or in a file of
    single-level variables."""
    kind = str(da.attrs.get("GRIB_typeOfLevel", "")).strip()
    if kind:
        return kind != "isobaricInhPa"
    return any(str(n) in SINGLE_NAMES for n in ds.data_vars)


def _with_level(where: str) -> str:
    stem, ext = os.path.splitext(os.path.basename(where))
    return f"{stem}_500hPa{ext}"


def _expver_parts(o: Opened) -> list[Opened]:
    """A dataset with an `expver` dimension of several (ERA5 = 1, ERA5T = 5): one part per
    experiment, each with the times it holds (a time both hold from the lowest number,
    ERA5); one variable's values at one grid point tell which."""
    ds = o.dataset
    names = [n for n in ds.data_vars if "expver" in ds[n].dims and "time" in ds[n].dims]
    if not names:
        return [Opened(o.where, ds.isel(expver=0), o.hours, o.span, o.limit, o.level_of,
                       o.apart)]
    probe = ds[names[0]]
    point = {d: 0 for d in probe.dims if d not in ("time", "expver")}
    values = np.asarray(probe.isel(point).transpose("expver", "time").values)
    labels = [str(v).strip() for v in np.asarray(ds["expver"].values).reshape(-1)]
    order = sorted(range(len(labels)), key=lambda i: (not labels[i].isdigit(),
                                                      int(labels[i]) if labels[i].isdigit()
                                                      else 0))
    taken = np.zeros(values.shape[1], dtype=bool)
    parts = []
    for i in order:
        mine = np.isfinite(values[i]) & ~taken
        taken |= mine
        keep = np.flatnonzero(mine)
        if len(keep):
            parts.append(Opened(f"{o.where} (expver {labels[i]})",
                                ds.isel(expver=i, time=keep), o.hours[keep], o.span, o.limit,
                                o.level_of, o.apart))
    return parts


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
        ds, level_of, apart = _normalised(where, ds)
        if "time" not in ds.indexes:  # e.g. a land-sea mask file: no channel needs it
            continue
        o = _cut(where, ds, first, end)
        o = Opened(o.where, o.dataset, o.hours, o.span, o.limit, level_of, apart)
        if "expver" in ds.dims:
            opened += _expver_parts(o)
        else:
            opened.append(o)
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
