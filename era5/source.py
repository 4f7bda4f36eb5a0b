"""ERA5 as the public copies hold it, opened lazily: the 20 channels of any 6-hourly time.

Two kinds of source (docs/real_era5.md says where to get them; era5/source_files.py opens
them):

  - a Zarr store in the WeatherBench-2 / ARCO-ERA5 layout: long variable names
    (`10m_u_component_of_wind`, `geopotential` with a `level` coordinate in hPa, ...),
    `time` hourly (ARCO) or 6-hourly (WeatherBench-2), `latitude` from north to south or
    (some WeatherBench-2 grids) ascending, dimensions in any order. A local path or a URL;
  - Copernicus CDS NetCDF files, a directory of them (or one file): short names (`u10`,
    `z`, ...), levels as `pressure_level` (older files: `level`), time as `valid_time`
    (older: `time`), split by variable, by pressure level or by month in any mix: each
    channel is found in whichever files hold its variable at its level, and joined in time.

Relative humidity comes out in percent whatever the source: WeatherBench-2's is a fraction
(x 100), the CDS `r` is percent (a variable without units: told by its range). It comes in
one of two definitions (data/humidity.py): WeatherBench-2's `relative_humidity` is its own
(over water), the CDS `r` is ECMWF's (mixed phase), and a store without it but with
specific humidity (ARCO-ERA5) gets ECMWF's, ERA5's own, derived. `rh_definition` asks for
one: where the source holds the other, it is derived from specific humidity and
temperature (a source without specific humidity at the level is refused in one line).
`channel_sources` says, per channel, what it was made from; `rh_definition` which one
came out.

Every channel is checked when the source is opened (a missing variable or level is a
one-line DataError naming it; so are a coordinate with a missing value and variables on
different grids), `select_year` checks that every 6-hourly time of a year is there, and
`read` refuses a NaN or infinity with a line naming the variable, level and time. A batch
reads each variable's chunks once for all its levels, and the variables in parallel threads
(`read_threads`: sized for a store's latency, not for the cores), as many at once as
READ_BYTES of chunks allows (at 0.25 degrees a variable's batch of chunks is ~0.9 GB).
Fields come out with rows from north to south and columns from 0 degrees east, as float32
in the channels' units (data/era5_names.py).
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from data.era5_names import CHANNELS, Channel, humidity_scale
from data.grid import Grid
from data.humidity import DEFINITIONS, ECMWF, WB2, relative_humidity
from era5.pieces import READ_BYTES, SPAN_BYTES, Budget, Piece, selection
from era5.source_files import EPOCH, HOUR, Opened, coordinate, open_source
from utils.errors import DataError

READ_THREADS = 16  # requests in flight: a remote store's latency hides behind the others
HUMIDITY = "relative_humidity"
DERIVE_FROM = (("specific_humidity", "q"), ("temperature", "t"))
# The definition of relative humidity a source's own variable holds, by its name (a store
# that records it, as the truth stores inference.py writes, says so in `rh_definition`).
OWN_DEFINITION = {HUMIDITY: WB2, "r": ECMWF}


@dataclass(eq=False)
class Field:
    """One variable at one level (or a single-level variable), over the pieces holding it;
    after `locate`, for each selected time its piece and index there."""

    variable: str
    level: float | None
    pieces: list[tuple[Piece, int | None]]  # (piece, level index in it)
    channels: list[str] = field(default_factory=list)  # the channels made from it
    which: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def label(self, channels: bool = True) -> str:
        """'temperature at 850 hPa (t850, r850)'; without the channels for `channels=False`."""
        text = self.variable + (f" at {self.level:g} hPa" if self.level is not None else "")
        return text + (f" ({', '.join(self.channels)})" if channels and self.channels else "")


class Source:
    """The 20 channels of an ERA5 source (module docstring), for times in [first, end)."""

    def __init__(self, path: str, first: np.datetime64, end: np.datetime64,
                 read_threads: int = READ_THREADS, rh_definition: str | None = None):
        self.path, self.read_threads = path, read_threads
        self._pieces: dict[str, list[Opened]] = defaultdict(list)
        self._grid_of: tuple[str, np.ndarray, np.ndarray] | None = None
        opened = open_source(path, np.datetime64(first, "h"), np.datetime64(end, "h"))
        self._opened = opened
        self._names = sorted({str(n) for o in opened for n in o.dataset.data_vars})
        for o in opened:
            for name in o.dataset.data_vars:
                self._pieces[str(name)].append(o)
        self._fields: dict[tuple[str, float | None], Field] = {}
        self._shared: dict[tuple[int, str], Piece] = {}
        self._own_rh = self._own_humidity()
        self.rh_definition = rh_definition or self._own_rh
        self.recipes = [self._recipe(c) for c in CHANNELS]
        for r in self.recipes:
            for f in r.inputs:
                f.channels.append(r.channel.name)
        where, lat, lon = self._grid_of  # type: ignore[misc]
        self._flip = len(lat) > 1 and lat[0] < lat[-1]
        lon = np.mod(lon, 360.0)
        self._columns = np.argsort(lon, kind="stable")
        self._reorder = not np.array_equal(self._columns, np.arange(len(lon)))
        self.grid = Grid((lat[::-1] if self._flip else lat).copy(), lon[self._columns])
        if not (np.diff(self.grid.latitude) < 0).all() or not (
                np.diff(self.grid.longitude) > 0).all():
            raise DataError(f"{where}: latitude and longitude must be monotonic")
        self.channel_sources = [r.describe() for r in self.recipes]
        self._times = np.zeros(0, dtype="datetime64[h]")
        self._pool: ThreadPoolExecutor | None = None  # started by the first read
        self._budget = Budget(READ_BYTES)

    # ------------------------------------------------------------------ opening
    def _field(self, names: tuple[str, str], level: int | None) -> Field | None:
        """The source's field of a variable (long or short name) at `level`, or None."""
        for name in names:
            if name not in self._pieces:
                continue
            key = (name, None if level is None else float(level))
            if key not in self._fields:
                pieces = [p for o in self._pieces[name]
                          if (p := self._piece(o, name, level)) is not None]
                if not pieces:
                    return None
                self._fields[key] = Field(name, key[1], pieces)
            return self._fields[key]
        return None

    def _piece(self, o: Opened, name: str, level: int | None) -> tuple[Piece, int | None] | None:
        da = o.dataset[name]
        plane = {"time", "latitude", "longitude"}
        expected = plane | ({"level"} if level is not None else set())
        if level is not None and set(da.dims) == plane and name in o.level_of:
            # one pressure level without a level dimension (era5/source_files.py)
            self._same_grid(o)
            return (Piece(da, None, o), None) if np.isclose(o.level_of[name], level) else None
        if set(da.dims) != expected:
            if level is not None and set(da.dims) == plane:
                raise DataError(f"{o.where}: '{name}' has no level coordinate")
            raise DataError(f"{o.where}: '{name}' has dimensions {tuple(da.dims)}, expected "
                            "time, latitude, longitude" + (" and level" if level else ""))
        self._same_grid(o)
        if level is None:
            return Piece(da, None, o), None
        levels = coordinate(o.dataset, "level", o.where)
        hit = np.flatnonzero(np.isclose(levels, level))
        if not len(hit):
            return None
        # One Piece per dataset and variable, shared by its levels' fields: a batch then
        # reads each chunk (every level of a variable) once for all of them.
        key = (id(o), name)
        if key not in self._shared:
            self._shared[key] = Piece(da, levels, o)
        return self._shared[key], int(hit[0])

    def _levels_of(self, names: tuple[str, str]) -> str:
        levels = sorted({float(v) for n in names for o in self._pieces.get(n, [])
                         for v in ([o.level_of[n]] if n in o.level_of else
                                   coordinate(o.dataset, "level", o.where)
                                   if "level" in o.dataset.coords else [])})
        return ", ".join(f"{v:g}" for v in levels)

    def _own_humidity(self) -> str:
        """The definition of the source's own relative humidity (ECMWF's where it has
        none: the one ERA5 itself holds)."""
        for name, default in OWN_DEFINITION.items():
            for o in self._pieces.get(name, []):
                recorded = str(o.dataset[name].attrs.get("rh_definition", ""))
                return recorded if recorded in DEFINITIONS else default
        return ECMWF

    def _recipe(self, c: Channel) -> Recipe:
        what = c.variable + (f" at {c.level} hPa" if c.level is not None else "")
        found = self._field((c.variable, c.short), c.level)
        humidity = c.variable == HUMIDITY
        if found is not None and (not humidity or self.rh_definition == self._own_rh):
            scale = self._humidity_scale(found) if humidity else 1.0
            return Recipe(c, (found,), scale)
        if humidity:
            inputs = [self._field(names, c.level) for names in DERIVE_FROM]
            if all(f is not None for f in inputs):
                return Recipe(c, tuple(inputs), 1.0,  # type: ignore[arg-type]
                              definition=self.rh_definition)
            if found is not None:
                raise DataError(
                    f"{self.path}: relative humidity at {c.level} hPa ('{found.variable}') "
                    f"is {DEFINITIONS[self._own_rh]}; {DEFINITIONS[self.rh_definition]} is "
                    "derived from specific humidity ('specific_humidity' or 'q') and "
                    f"temperature at {c.level} hPa, which the source lacks: add them, or "
                    f"prepare with --rh_definition {self._own_rh}")
        names = (c.variable, c.short)
        if any(n in self._pieces for n in names):
            name = next(n for n in names if n in self._pieces)
            raise DataError(f"{self.path} lacks channel {c.name} ({what}): '{name}' has "
                            f"levels {self._levels_of(names) or 'none'}"
                            + self._apart_note(name))
        also = (", nor 'specific_humidity' or 'q' and 'temperature' or 't' at that level "
                "to derive it from" if humidity else "")
        raise DataError(f"{self.path} lacks channel {c.name} ({what}): no variable "
                        f"'{c.variable}' or '{c.short}'{also} (variables: "
                        f"{', '.join(self._names) or 'none'})")

    def _humidity_scale(self, found: Field) -> float:
        """Percent per unit of a relative humidity field: by its units, or without units
        by the range of its first time in the source."""
        piece, level = found.pieces[0]
        units = piece.array.attrs.get("units")
        sample = None
        if not str(units or "").strip():
            with_times = [(p, k) for p, k in found.pieces if len(p.opened.hours)]
            if with_times:
                piece, level = with_times[0]
                index: dict[str, Any] = {"time": 0}
                if level is not None:
                    index["level"] = level
                sample = np.asarray(piece.array.isel(index).values)
            else:  # no time in the years asked for: select_year says so
                return 1.0
        return humidity_scale(found.variable, units, piece.where, sample)

    def _apart_note(self, name: str) -> str:
        """'; era5_single.nc holds a surface 'z', kept apart' for a name that files hold
        as a surface field (era5/source_files.py)."""
        files = [o.where for o in self._opened if name in o.apart]
        files = list(dict.fromkeys(files))
        return (f"; {', '.join(files)} hold(s) a surface '{name}', kept apart"
                if files else "")

    def _same_grid(self, o: Opened) -> None:
        lat = coordinate(o.dataset, "latitude", o.where)
        lon = coordinate(o.dataset, "longitude", o.where)
        if self._grid_of is None:
            self._grid_of = (o.where, lat, lon)
            return
        first, lat0, lon0 = self._grid_of
        if lat.shape != lat0.shape or lon.shape != lon0.shape or not (
                np.allclose(lat, lat0) and np.allclose(lon, lon0)):
            raise DataError(f"{self.path} mixes grids: {o.where} is {len(lat)} x {len(lon)} "
                            f"(latitude {lat[0]:g} .. {lat[-1]:g}), {first} is {len(lat0)} x "
                            f"{len(lon0)} (latitude {lat0[0]:g} .. {lat0[-1]:g})")

    @property
    def fields(self) -> list[Field]:
        return list(dict.fromkeys(f for r in self.recipes for f in r.inputs))

    # ------------------------------------------------------------------ times
    def select_year(self, year: int, limit: int | None = None) -> np.ndarray:
        """Choose the year `read` reads: its 6-hourly times from 00 UTC on 1 January (the
        first `limit`), each checked to be in every field (datetime64[h]); a DataError
        names the first missing one."""
        times = year_times(year)[:limit]
        wanted = ((times - EPOCH) / HOUR).astype(np.int64)
        for f in self.fields:
            _locate(f, wanted, times, year, self.path)
        self._times = times
        return times

    # ------------------------------------------------------------------ reading
    def read(self, start: int, stop: int, rows: int | None = None) -> np.ndarray:
        """(stop - start, 20, H, W) float32: samples start .. stop - 1 of the selected year,
        rows from north to south (the first `rows` of them), columns from 0 degrees east.
        A NaN or infinity in what was read is a DataError naming the variable, level and
        time."""
        values = self._read_fields(start, stop)
        for f, x in values.items():
            _check_finite(f, x, self._times[start:stop], f.which[start:stop])
        H, W = self.grid.shape
        rows = H if rows is None else rows
        out = np.empty((stop - start, len(self.recipes), rows, W), dtype=np.float32)
        for c, r in enumerate(self.recipes):  # each channel copied once, into its place
            x = r.make(values)
            x = x[:, ::-1] if self._flip else x
            x = x[:, :rows]
            out[:, c] = x[..., self._columns] if self._reorder else x
        return out

    def _read_fields(self, start: int, stop: int) -> dict[Field, np.ndarray]:
        """Every field's (B, H, W) at the batch's times: one request per piece, variable
        and run of times, covering all the levels asked of it (a chunk holds every level)."""
        requests: dict[tuple[int, bytes], tuple[Piece, Any, list, list]] = {}
        for f in self.fields:
            which, index = f.which[start:stop], f.index[start:stop]
            for p in np.unique(which):
                rows = np.flatnonzero(which == p)
                piece, level = f.pieces[p]
                key = (id(piece), index[rows].tobytes())
                if key not in requests:
                    requests[key] = (piece, selection(index[rows]), [], [])
                requests[key][2].append(level)
                requests[key][3].append((f, rows))
        shape = (stop - start, len(self._grid_of[1]), len(self._grid_of[2]))  # type: ignore[index]
        out = {f: np.empty(shape, dtype=np.float32) for f in self.fields}

        def fetch(request: tuple[Piece, Any, list, list]) -> None:
            piece, times, levels, users = request
            index: dict[str, Any] = {"time": times}
            n = len(range(times.start, times.stop, times.step or 1)) if isinstance(
                times, slice) else len(times)
            wanted = sorted({lev for lev in levels if lev is not None})
            at = {lev: k for k, lev in enumerate(wanted)}  # a level's place in the block
            count = max(len(wanted), 1)  # levels read
            if wanted:
                # The run of levels from the first wanted to the last is a basic selection,
                # faster than a list; the list where the run holds many more levels than
                # wanted in much memory (0.25 degrees).
                span = wanted[-1] - wanted[0] + 1
                index["level"] = wanted
                if span <= 2 * len(wanted) or n * span * piece.plane_bytes <= SPAN_BYTES:
                    index["level"], count = slice(wanted[0], wanted[-1] + 1), span
                    at = {lev: lev - wanted[0] for lev in wanted}
            with self._budget.take(piece.read_bytes(n, count)):
                block = piece.read(index)
                for level, (f, rows) in zip(levels, users, strict=True):
                    out[f][rows] = block if level is None else block[:, at[level]]
                del block

        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix="read")
        list(self._pool.map(fetch, requests.values()))
        return out


@dataclass(frozen=True)
class Recipe:
    """How one channel is made from the source's fields."""

    channel: Channel
    inputs: tuple[Field, ...]
    scale: float
    definition: str | None = None  # derived relative humidity: ECMWF or WB2

    @property
    def derived(self) -> bool:
        return self.definition is not None

    def make(self, values: dict[Field, np.ndarray]) -> np.ndarray:
        if self.derived:  # relative humidity in percent from q, T and the level's pressure
            q, t = (values[f] for f in self.inputs)
            return (100.0 * relative_humidity(q, t, 100.0 * self.channel.level,
                                              self.definition)).astype(np.float32)
        x = values[self.inputs[0]]
        return x if self.scale == 1.0 else x * np.float32(self.scale)

    def describe(self) -> str:
        """'temperature at 850 hPa', 'relative_humidity at 500 hPa x 100', 'derived:
        relative humidity from specific_humidity at 500 hPa, temperature at 500 hPa (IFS
        formula, mixed phase; ...)'."""
        if self.derived:
            formula = ("IFS formula, mixed phase" if self.definition == ECMWF else
                       "WeatherBench-2's formula, over water")
            return ("derived: relative humidity from "
                    + ", ".join(f.label(channels=False) for f in self.inputs)
                    + f" ({formula}; data/humidity.py)")
        return self.inputs[0].label(channels=False) + (
            f" x {self.scale:g}" if self.scale != 1.0 else "")


def _locate(f: Field, wanted: np.ndarray, times: np.ndarray, year: int, path: str) -> None:
    """Find each wanted time (hours) in the field's pieces (the first piece holding a time
    wins); a DataError names the first time that is missing."""
    hours = np.concatenate([p.opened.hours for p, _ in f.pieces])
    owner = np.concatenate([np.full(len(p.opened.hours), k)
                            for k, (p, _) in enumerate(f.pieces)])
    local = np.concatenate([np.arange(len(p.opened.hours)) for p, _ in f.pieces])
    order = np.argsort(hours, kind="stable")  # the pieces' own times: a few years at most
    hours, owner, local = hours[order], owner[order], local[order]
    pos = np.minimum(np.searchsorted(hours, wanted), max(len(hours) - 1, 0))
    found = (hours[pos] == wanted) if len(hours) else np.zeros(len(wanted), bool)
    missing = times[~found]
    name = f.label()
    if len(missing) == len(times):
        first = min(p.opened.span[0] for p, _ in f.pieces)
        last = max(p.opened.span[1] for p, _ in f.pieces)
        covers = f"{_when(first)[:10]} to {_when(last)[:10]}" if last >= first else "nothing"
        raise DataError(f"{path} has no {name} in {year} (it covers {covers})")
    if len(missing):
        have = times[found]
        inside = missing[(missing > have[0]) & (missing < have[-1])]
        if len(inside):
            more = f" (and {len(inside) - 1} more)" if len(inside) > 1 else ""
            raise DataError(f"{path} has a gap in time in {year}: no {name} at "
                            f"{inside[0]}{more}")
        limit = next((p.opened.limit for p, _ in f.pieces if p.opened.limit), "")
        raise DataError(f"{path} has {name} from {have[0]} to {have[-1]}"
                        + (f" ({limit})" if limit else "")
                        + f": {len(missing)} of the {len(times)} 6-hourly times of {year} "
                        "are outside it (--max_samples N prepares only the first N of a year)")
    f.which, f.index = owner[pos], local[pos]


def _when(hours: int) -> str:
    return str(EPOCH + int(hours) * HOUR)


def _check_finite(f: Field, x: np.ndarray, times: np.ndarray, which: np.ndarray) -> None:
    """A DataError naming the variable, level and first time of a NaN or infinity in `x`
    (B, H, W), read at `times` from the pieces `which`."""
    bad = ~np.isfinite(x)
    if bad.any():
        rows = np.flatnonzero(bad.reshape(len(x), -1).any(axis=1))
        what = "NaN" if np.isnan(x[rows[0]]).any() else "infinite"
        more = f" (and at {len(rows) - 1} more of the batch's times)" if len(rows) > 1 else ""
        where = f.pieces[which[rows[0]]][0].where
        raise DataError(f"{where}: {f.label()} has {int(bad[rows[0]].sum())} "
                        f"{what} value(s) at {times[rows[0]]}{more}; nothing of "
                        f"{str(times[0])[:4]} was written")


def year_times(year: int) -> np.ndarray:
    """Every 6-hourly time of a year from 00 UTC on 1 January: 1460, or 1464 in a leap year."""
    start = np.datetime64(f"{year}-01-01T00", "h")
    end = np.datetime64(f"{year + 1}-01-01T00", "h")
    return np.arange(start, end, 6 * HOUR)
