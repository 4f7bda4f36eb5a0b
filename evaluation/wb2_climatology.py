"""WeatherBench-2's climatology store as the anomaly reference of ACC and the climatology
baseline (`inference.py --climatology PATH`), so that both are measured against its
climatology instead of the data set's harmonic fit (data/climatology.py; docs/scoring.md
says how the two differ).

The store's layout, as WeatherBench-2's climatologies (its data guide: `era5-hourly-
climatology/1990-2019_6h_<grid>.zarr`) hold it: each variable under its WeatherBench-2 name
(or the name with `_mean`), on dimensions `dayofyear` (1 .. 366) and `hour` (0 .. 23, or
every 6 h), `latitude`, `longitude` and, on pressure levels, `level` (hPa), in any order; in
its units (relative humidity a fraction; without a units attribute, told by its range) and
its definition of relative humidity (over water, data/humidity.py; a store that records
another in an `rh_definition` attribute has that one). A forecast valid at time t is
compared with the entry at t's day of year and hour of day, as its evaluation selects it.
The store's rows and columns are matched by coordinate to the grid scored, to
WeatherBench-2's tolerance of 1e-3 degrees: the same grid or a crop of it; a grid it does
not contain (block means) is refused. A `gs://` store is read anonymously, as the data.

Reading at 0.25 degrees: a chunk of the public store holds 3 days x 3 hours of one
variable at one level on the whole grid (37 MB), so a (day, hour) plane read alone would
decode 9 planes to use one. Reads are chunk-aligned instead: told the valid times it will be
asked for (`plan`), a chunk is read once and every plane of it that a planned time needs is
kept, cut to the grid scored, until its last use; without a plan, the planes are kept for
later. Either way the planes kept are bounded by `cache_bytes` (the least recently used go
first, and are read again if asked for again): memory does not grow with the number of
initial conditions. `reads` counts the chunk reads, `planes_read` the planes kept.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

import numpy as np

from data.era5_names import channel, humidity_scale, wb2_units
from data.grid import Grid
from data.humidity import DEFINITIONS, WB2
from utils.errors import DataError

TOLERANCE = 1e-3  # degrees, WeatherBench-2's `_ensure_aligned_grid`
EPOCH = np.datetime64("1970-01-01T00", "h")
CACHE_BYTES = 3 * 2**30  # planes kept at most: ~35 (day, hour)s of 21 channels at 0.25 degrees
HUMIDITY = "relative_humidity"


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


def open_store(path: str) -> Any:
    """The climatology store, lazily; `gs://` anonymously. One line if it cannot be."""
    import xarray as xr

    options = {"token": "anon"} if path.startswith(("gs://", "gcs://")) else None
    try:
        return xr.open_dataset(path, engine="zarr", chunks=None, cache=False,
                               storage_options=options)
    except Exception as e:  # a path with no store, a file that is not Zarr: one line
        raise DataError(f"--climatology {path}: not a Zarr store "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                        ) from None


class _Variable:
    """One variable of the store and the channels read from it (one per level)."""

    def __init__(self, array: Any, name: str):
        self.array, self.name = array, name
        self.channels: list[tuple[int, int | None, float]] = []  # (channel, level index, factor)
        chunks = array.encoding.get("chunks") or array.encoding.get("preferred_chunks")
        if isinstance(chunks, dict):
            chunks = tuple(chunks.get(d, array.sizes[d]) for d in array.dims)
        sizes = dict(zip(array.dims, chunks or array.shape, strict=True))
        self.day_chunk, self.hour_chunk = sizes["dayofyear"], sizes["hour"]


class StoreClimatology:
    """The climatology of `channels` on `grid` (rows north to south), read from a
    WeatherBench-2 climatology store in chunk-aligned reads (module docstring), in the
    prepared files' units."""

    def __init__(self, path: str, channels: list[str], grid: Grid,
                 cache_bytes: int = CACHE_BYTES):
        self.path, self.channels, self.cache_bytes = path, list(channels), cache_bytes
        ds = open_store(path)
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
        self._variables: dict[str, _Variable] = {}
        self.rh_definition = ""
        for c, name in enumerate(self.channels):
            self._add(ds, c, name)
        self._plane_bytes = len(self.channels) * len(self._rows) * len(self._cols) * 4
        self._planes: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._uses: Counter[tuple[int, int]] = Counter()
        self.reads = self.planes_read = 0

    def _add(self, ds: Any, c: int, name: str) -> None:
        """Channel `c`: its variable, level and the factor to the prepared files' units."""
        info = channel(name)
        if info is None:
            raise DataError(f"--climatology {self.path}: channel {name} has no "
                            "WeatherBench-2 name (data/era5_names.py)")
        variable = next((v for v in (info.variable, f"{info.variable}_mean") if v in ds), None)
        if variable is None:
            raise DataError(f"--climatology {self.path} lacks '{info.variable}' (channel "
                            f"{name}); it has {', '.join(sorted(map(str, ds.data_vars)))}")
        if variable not in self._variables:
            self._variables[variable] = _Variable(ds[variable], variable)
        entry = self._variables[variable]
        level = None
        if info.level is not None:
            levels = np.asarray(ds["level"].values, dtype=np.float64) if "level" in ds.coords \
                else np.zeros(0)
            hit = np.flatnonzero(np.isclose(levels, info.level))
            if not len(hit):
                raise DataError(f"--climatology {self.path} has no '{variable}' at "
                                f"{info.level} hPa (channel {name})")
            level = int(hit[0])
        if info.variable == HUMIDITY:  # to percent: by its units, else by its range
            da = entry.array
            sample = None
            if not str(da.attrs.get("units", "")).strip():
                first = {"dayofyear": 0, "hour": 0, **({"level": level} if level is not None
                                                        else {})}
                sample = np.asarray(da.isel(first).values)
            factor = humidity_scale(variable, da.attrs.get("units"),
                                    f"--climatology {self.path}", sample)
            recorded = str(da.attrs.get("rh_definition", ""))
            self.rh_definition = recorded if recorded in DEFINITIONS else WB2
        else:
            factor = 1.0 / wb2_units(info.variable)[1]
        entry.channels.append((c, level, factor))

    # ------------------------------------------------------------------ reading
    def _index(self, day: int, hour: int) -> tuple[int, int]:
        i = np.flatnonzero(self._days == day)
        j = np.flatnonzero(self._hours == hour)
        if not len(i) or not len(j):
            raise DataError(f"--climatology {self.path} has no entry for day of year "
                            f"{day} at {hour} h (hours {self._hours.tolist()})")
        return int(i[0]), int(j[0])

    def plan(self, hours: np.ndarray) -> None:
        """The valid times (hours since 1970, any shape, repeats counted) `at` will be
        asked for: a chunk read keeps the planes they need until their last use."""
        days, hour = day_and_hour(np.asarray(hours, dtype=np.int64).reshape(-1))
        self._uses = Counter(self._index(int(d), int(h)) for d, h in zip(days, hour,
                                                                          strict=True))

    def _read(self, key: tuple[int, int]) -> None:
        """Read the chunks holding plane `key` (every variable's), keeping each plane they
        all hold that is planned (or, without a plan, every one)."""
        i, j = key
        spans = {}
        for name, v in self._variables.items():
            d0, h0 = i - i % v.day_chunk, j - j % v.hour_chunk
            spans[name] = (slice(d0, min(d0 + v.day_chunk, len(self._days))),
                           slice(h0, min(h0 + v.hour_chunk, len(self._hours))))
        days = range(max(d.start for d, _ in spans.values()),
                     min(d.stop for d, _ in spans.values()))
        hours = range(max(h.start for _, h in spans.values()),
                      min(h.stop for _, h in spans.values()))
        wanted = [(a, b) for a in days for b in hours if (a, b) == key or (
            (a, b) not in self._planes and (self._uses[(a, b)] > 0 or not self._uses))]
        kept = {k: np.empty((len(self.channels), len(self._rows), len(self._cols)),
                            np.float32) for k in wanted}
        for name, v in self._variables.items():
            day_span, hour_span = spans[name]
            levels = sorted({lev for _, lev, _ in v.channels if lev is not None})
            index: dict[str, Any] = {"dayofyear": day_span, "hour": hour_span}
            if levels:
                index["level"] = levels
            block = v.array.isel(index)
            order = ("dayofyear", "hour") + (("level",) if levels else ()) + (
                "latitude", "longitude")
            block = np.asarray(block.values).transpose([block.dims.index(d) for d in order])
            self.reads += 1
            for (a, b), plane in kept.items():
                field = block[a - day_span.start, b - hour_span.start]
                for c, lev, factor in v.channels:
                    x = field[levels.index(lev)] if lev is not None else field
                    np.multiply(x[np.ix_(self._rows, self._cols)], factor, out=plane[c],
                                casting="unsafe")
            del block
        for k, plane in kept.items():
            self._planes[k] = plane
        self.planes_read += len(kept)
        self._evict(keep=key)

    def _evict(self, keep: tuple[int, int]) -> None:
        while len(self._planes) * self._plane_bytes > self.cache_bytes and len(self._planes) > 1:
            oldest = next(k for k in self._planes if k != keep)
            del self._planes[oldest]

    def _at(self, day: int, hour: int) -> np.ndarray:
        """(C, H, W) float32 at one day of year and hour."""
        key = self._index(day, hour)
        if key not in self._planes:
            self._read(key)
        plane = self._planes[key]
        self._planes.move_to_end(key)
        if self._uses:
            self._uses[key] -= 1
            if self._uses[key] <= 0:  # its last planned use
                del self._planes[key]
        return plane

    def at(self, hours: np.ndarray) -> np.ndarray:
        """(..., C, H, W) float32: the climatology at each valid time (hours since 1970)."""
        hours = np.asarray(hours, dtype=np.int64)
        days, hour = day_and_hour(hours.reshape(-1))
        fields = np.stack([self._at(int(d), int(h)) for d, h in zip(days, hour, strict=True)])
        return fields.reshape(*hours.shape, *fields.shape[1:])

    def cached_bytes(self) -> int:
        return len(self._planes) * self._plane_bytes
