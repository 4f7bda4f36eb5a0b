"""Initial conditions and verifying truth for rollouts, read from the test split.

A rollout of L steps from sample i of a year file needs samples i, i + dt, ..., i + L*dt:
one HDF5 hyperslab read per file it touches, cropped to `img_size` and normalised with the
global means and stds exactly like the training loader (data.dataset.ERA5Dataset, which
also checks the files, their grid and the statistics here). Year files whose times continue
each other (the next one's first sample 6 h after this one's last: consecutive prepared
years) form one run, and a rollout from late December reads its truth from the next year,
as WeatherBench-2 scores every initial time whose truth exists.

The time of every sample comes from the file's `time` dataset (hours since 1970-01-01;
files without one: 6-hourly from 00 UTC on 1 January of the year the file is named after),
and its place in the seasonal cycle from its index in the file and the file's
`samples_per_year` attribute (the climatology's year fraction, data/climatology.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
import torch

from data.climatology import sample_times
from data.dataset import ERA5Dataset
from data.era5_names import CHANNEL_NAMES
from utils.config_schema import Config
from utils.errors import DataError
from utils.tile import Tile

HOURS_PER_SAMPLE = 6
# Initial conditions when --n_initial_conditions is not given (fewer if the test split has
# fewer): on the synthetic test year (128 samples) the scores of 32 evenly spaced ones are
# within a few percent of those of all of them.
DEFAULT_INITIAL_CONDITIONS = 32


@dataclass(frozen=True)
class InitialCondition:
    file: str   # path of the year file
    index: int  # sample index within it

    def to_dict(self) -> dict[str, Any]:
        return {"file": os.path.basename(self.file), "index": self.index}


class RolloutData:
    """The test split, read as windows x_0 .. x_L of consecutive samples."""

    def __init__(self, cfg: Config, location: str):
        self.location = location
        data = ERA5Dataset(cfg, location, train=False)  # one-line DataError if anything is off
        self.files, self.dt, self.img_size = data.files, data.dt, data.img_size
        self.grid = data.grid  # cropped to img_size
        self.lengths = [n + self.dt for n in data.samples_per_file]  # samples per file
        self.means, self.stds = data.means, data.stds  # (C, 1, 1)
        self._fields: dict[str, h5py.Dataset] = {}
        self._times = {path: file_times(path, n)
                       for path, n in zip(self.files, self.lengths, strict=True)}
        self.runs = _runs(self.files, self.lengths, self._times)
        self._place = {path: (r, offset) for r, run in enumerate(self.runs)
                       for path, offset, _ in run}
        self.rh_definition = _rh_definition(self.files, location)

    def channel_names(self) -> list[str]:
        """From the files' `channel_names` attribute (the synthetic data writes it), else
        the ERA5 order of the tutorial."""
        C = len(self.means)
        with h5py.File(self.files[0], "r") as f:
            names = [n.decode() if isinstance(n, bytes) else str(n)
                     for n in f["fields"].attrs.get("channel_names", [])]
        if len(names) >= C:
            return names[:C]
        return [CHANNEL_NAMES[c] if c < len(CHANNEL_NAMES) else f"ch{c}" for c in range(C)]

    def _window(self, ic: InitialCondition, lead_steps: int) -> list[tuple[str, slice]]:
        """[(file, rows)] holding samples i, i + dt, ..., i + L*dt of `ic`'s run: a strided
        slice of each file the window touches."""
        r, offset = self._place[ic.file]
        start, stop = offset + ic.index, offset + ic.index + lead_steps * self.dt + 1
        out = []
        for path, first, n in self.runs[r]:
            a = max(start, first)
            a += (start - a) % self.dt  # the first row of the window in this file
            if a < min(stop, first + n):
                out.append((path, slice(a - first, min(stop, first + n) - first, self.dt)))
        return out

    def valid_times(self, ics: list[InitialCondition], lead_steps: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(hours since 1970-01-01, year fraction, UTC hour of day), each (B, L+1), of the
        samples a rollout from each initial condition is scored against."""
        picked = [[np.concatenate([self._times[path][k][rows]
                                   for path, rows in self._window(ic, lead_steps)])
                   for k in range(3)] for ic in ics]
        return tuple(np.stack([p[k] for p in picked]) for k in range(3))  # type: ignore[return-value]

    def lead_hours(self, lead_steps: int) -> list[int]:
        return [k * self.dt * HOURS_PER_SAMPLE for k in range(lead_steps + 1)]

    def candidates(self, lead_steps: int) -> list[InitialCondition]:
        """Every sample whose rollout of `lead_steps` has its truth: inside its run of
        consecutive year files."""
        span = lead_steps * self.dt
        out = []
        for run in self.runs:
            total = run[-1][1] + run[-1][2]
            out += [InitialCondition(path, i) for path, first, n in run
                    for i in range(max(min(n, total - span - first), 0))]
        return out

    def pick(self, n: int | None, lead_steps: int, hours: list[int] | None = None
             ) -> list[InitialCondition]:
        """`n` initial conditions spread evenly over the split (in time order), among those
        at the UTC `hours` of day (None: any; WeatherBench-2's baselines start at 0 and 12);
        n None: the default number, or all there are if fewer."""
        if lead_steps < 1:
            raise DataError(f"--lead_steps must be at least 1, got {lead_steps}")
        allowed = self.candidates(lead_steps)
        if hours is not None:
            at = {path: np.mod(self._times[path][0], 24) for path in self.files}
            allowed = [ic for ic in allowed if int(at[ic.file][ic.index]) in hours]
            if not allowed:
                raise DataError(f"--init_hours {','.join(map(str, hours))}: {self.location} "
                                f"has no initial condition at those hours of the day (its "
                                f"samples are at {_hours_of_day(at)} UTC)")
        if not allowed:
            longest = max(run[-1][1] + run[-1][2] for run in self.runs)
            raise DataError(f"{self.location}: a {lead_steps}-step rollout needs "
                            f"{lead_steps * self.dt + 1} consecutive samples (a year file, or "
                            f"consecutive years), the longest run has {longest}; lower "
                            "--lead_steps")
        if n is None:
            n = min(DEFAULT_INITIAL_CONDITIONS, len(allowed))
        if not 1 <= n <= len(allowed):
            raise DataError(f"--n_initial_conditions {n}: {self.location} has "
                            f"{len(allowed)} initial conditions with room for {lead_steps} "
                            f"steps (choose 1..{len(allowed)}, or lower --lead_steps)")
        # Evenly spaced positions; the spacing is >= 1, so rounding keeps them distinct.
        positions = np.floor(np.linspace(0, len(allowed) - 1, n) + 0.5).astype(int)
        return [allowed[p] for p in positions]

    def read_lead(self, ics: list[InitialCondition], lead: int,
                  tile: Tile | None = None) -> torch.Tensor:
        """(B, C, H, W) normalised fields `lead` steps after each initial condition (its
        truth at that lead): `read`'s window at one lead, one sample per file read."""
        tile = tile or Tile.whole(self.img_size)
        out = None
        for b, ic in enumerate(ics):
            path, row = self._at(ic, lead)
            x = self._dataset(path)[row, :, tile.rows, tile.cols]
            if out is None:
                out = np.empty((len(ics), *x.shape), dtype=np.float32)
            out[b] = x
        assert out is not None, "no initial condition"
        out -= self.means
        out /= self.stds
        return torch.from_numpy(out)

    def _at(self, ic: InitialCondition, lead: int) -> tuple[str, int]:
        """(file, row) of the sample `lead` steps of dt after `ic`, within its run."""
        r, offset = self._place[ic.file]
        position = offset + ic.index + lead * self.dt
        for path, first, n in self.runs[r]:
            if first <= position < first + n:
                return path, position - first
        raise DataError(f"{self.location}: no sample {lead} steps after {ic.to_dict()}")

    def _dataset(self, path: str) -> h5py.Dataset:
        if path not in self._fields:
            self._fields[path] = h5py.File(path, "r")["fields"]
        return self._fields[path]

    def read(self, ics: list[InitialCondition], lead_steps: int,
             tile: Tile | None = None) -> torch.Tensor:
        """(B, L+1, C, H, W) normalised fields at leads 0..L of each initial condition;
        with a `tile` (spatial parallelism), only its rows and columns of the grid."""
        tile = tile or Tile.whole(self.img_size)
        windows = []
        for ic in ics:
            # One hyperslab per file: rows i, i+dt, ..., i+span; the tile's grid points.
            parts = [self._dataset(path)[rows, :, tile.rows, tile.cols]
                     for path, rows in self._window(ic, lead_steps)]
            x = parts[0] if len(parts) == 1 else np.concatenate(parts)
            x -= self.means
            x /= self.stds
            windows.append(torch.from_numpy(x))
        return torch.stack(windows)

    def read_at(self, hours: np.ndarray) -> np.ndarray:
        """(n, C, H, W) fields in physical units (not normalised), cropped to img_size, of
        the samples at `hours` (hours since 1970-01-01, each in the split; else DataError)."""
        files = list(self._times)
        every = np.concatenate([self._times[f][0] for f in files])
        owner = np.concatenate([np.full(len(self._times[f][0]), k) for k, f in
                                enumerate(files)])
        row = np.concatenate([np.arange(len(self._times[f][0])) for f in files])
        order = np.argsort(every, kind="stable")
        pos = np.searchsorted(every[order], hours)
        pos = order[np.minimum(pos, len(order) - 1)]
        missing = np.asarray(hours)[every[pos] != hours]
        if len(missing):
            when = np.datetime64("1970-01-01T00", "h") + int(missing[0]) * np.timedelta64(1, "h")
            raise DataError(f"{self.location} has no sample at {when}")
        H, W = self.img_size
        return np.stack([self._dataset(files[owner[p]])[row[p], :, :H, :W] for p in pos])

    def close(self) -> None:
        for ds in self._fields.values():
            ds.file.close()
        self._fields.clear()


def _runs(files: list[str], lengths: list[int],
          times: dict[str, tuple[np.ndarray, ...]]) -> list[list[tuple[str, int, int]]]:
    """Files grouped into runs of continuing times: [[(file, its first position in the
    run, samples)]]."""
    runs: list[list[tuple[str, int, int]]] = []
    for path, n in zip(files, lengths, strict=True):
        if runs:
            last, first, m = runs[-1][-1]
            if m and n and times[path][0][0] - times[last][0][m - 1] == HOURS_PER_SAMPLE:
                runs[-1].append((path, first + m, n))
                continue
        runs.append([(path, 0, n)])
    return runs


def _hours_of_day(at: dict[str, np.ndarray]) -> str:
    return ", ".join(str(h) for h in sorted({int(h) for v in at.values() for h in v}))


def _rh_definition(files: list[str], location: str) -> str:
    """The definition of relative humidity the files record (data/humidity.py), "" if
    none does; files of two definitions are a DataError."""
    seen: dict[str, str] = {}
    for path in files:
        with h5py.File(path, "r") as f:
            definition = str(f["fields"].attrs.get("rh_definition", ""))
        if definition:
            seen.setdefault(definition, path)
    if len(seen) > 1:
        (a, pa), (b, pb) = list(seen.items())[:2]
        raise DataError(f"{location} mixes relative humidity definitions: {pa} holds '{a}', "
                        f"{pb} '{b}'; prepare the split again with one --rh_definition")
    return next(iter(seen), "")


def file_times(path: str, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(hours since 1970-01-01, year fraction, UTC hour) of each of a file's n samples."""
    with h5py.File(path, "r") as f:
        spy = int(f["fields"].attrs.get("samples_per_year", n))
        hours = f["time"][:n].astype(np.int64) if "time" in f else None
    if hours is None or len(hours) != n:
        stem = os.path.splitext(os.path.basename(path))[0]
        year = int(stem) if stem.isdigit() and 1000 <= int(stem) <= 9999 else 1970
        jan1 = np.datetime64(f"{year}-01-01T00", "h") - np.datetime64("1970-01-01T00", "h")
        hours = jan1.astype(np.int64) + HOURS_PER_SAMPLE * np.arange(n, dtype=np.int64)
    phase, hour = sample_times(hours, spy)
    return hours, phase, hour
