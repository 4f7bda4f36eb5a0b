"""Statistics of the training years: written from partial sums that merge exactly, and
read back checked (`load_stats`, `load_stds`, `stats_grid`, `score_grid`: the loaders
normalise with them, the scores weight and compare with them; `check_stats` names the file
and the first channel of a value that is not finite, or of a standard deviation not > 0).

Each year (each worker, each SLURM array task) accumulates its own `PartialSums` while it
writes, batch by batch; the stats/ files are computed from the merge of all training years'
sums. Merging is exact arithmetic on sums (the order changes only float64 round-off, ~1e-15
relative), so the result is what one pass over all training samples gives:

  - global_means, global_stds (1, C, 1, 1): per channel, over every sample and grid point
    (population std). Kept as (count, mean, sum of squared deviations) per channel and
    merged with Chan et al.'s pairwise formula, which stays accurate where a plain sum of
    squares loses digits (geopotential ~5e4 m2/s2 with a std of ~3e3);
  - time_means (1, C, H, W): the mean over samples of each grid point;
  - the harmonic climatology (data/climatology.py): the normal equations X^T X and
    X^T Y of the least-squares fit, where X holds the 14 harmonic terms of each sample's
    time and Y its fields (the 20 channels and the derived 10 m wind speed). The constant
    term's row of X^T Y is the sum of the samples: time_means comes from it.

Memory: X^T Y is float64, 14 x 21 x H x W x 8 bytes: 2.4 GB at 720 x 1440, 0.6 GB at
360 x 720, 19 MB at 64 x 128; X^T X and the per-channel numbers are small. Merging adds
into the first year's arrays, and the harmonics are solved a channel at a time into
float32, so writing stats/ holds about two years' sums and half of one more.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.climatology import TERMS, basis, save_climatology, save_npz
from data.era5_names import CHANNEL_NAMES, WIND_COMPONENTS, WIND_SPEED, channel_label
from data.grid import Grid, crop_to, load_stats_grid, save_stats_grid
from utils.config_schema import Config
from utils.errors import DataError


def derived_names(channels: int) -> tuple[str, ...]:
    """Names of the fields the sums cover: the tutorial's 20 channels and 10 m wind speed,
    or ch0, ch1, ... for another number of channels."""
    if channels != len(CHANNEL_NAMES):
        return tuple(f"ch{c}" for c in range(channels))
    return (*CHANNEL_NAMES, WIND_SPEED.name)


def channel_fields(x: np.ndarray) -> Iterator[np.ndarray]:
    """Each channel of (B, C, H, W) fields as float64 (B, H, W), then the derived 10 m wind
    speed when the channels are the tutorial's: one channel in float64 at a time."""
    for c in range(x.shape[1]):
        yield x[:, c].astype(np.float64)
    if x.shape[1] == len(CHANNEL_NAMES):
        u, v = (x[:, CHANNEL_NAMES.index(n)].astype(np.float64) for n in WIND_COMPONENTS)
        yield np.hypot(u, v)


@dataclass
class PartialSums:
    """Sums over the samples seen so far (module docstring); `empty()` to start."""

    count: int                # samples
    mean: np.ndarray          # (C,) float64: per-channel mean over samples and grid points
    m2: np.ndarray            # (C,) float64: sum of squared deviations from `mean`
    xtx: np.ndarray           # (T, T) float64
    xty: np.ndarray           # (T, C', H, W) float64
    channels: tuple[str, ...]  # C' names: the channels and the derived fields

    @staticmethod
    def nbytes(channels: int, H: int, W: int) -> int:
        """Bytes of the sums of `channels` channels (and the derived ones) on H x W."""
        return len(TERMS) * len(derived_names(channels)) * H * W * 8

    @classmethod
    def empty(cls) -> PartialSums:
        none = np.zeros(0)
        return cls(0, none, none, np.zeros((len(TERMS), len(TERMS))), none, ())

    def add(self, x: np.ndarray, phase: np.ndarray, hour: np.ndarray) -> None:
        """Add a batch of samples (B, C, H, W) at year fractions `phase` (B,) and UTC hours
        `hour` (B,). Channel by channel: the float64 temporaries are one channel's."""
        B, C, H, W = x.shape
        design = basis(phase, hour)  # (B, T)
        if self.count == 0:
            self.channels = derived_names(C)
            self.mean, self.m2 = np.zeros(C), np.zeros(C)
            self.xty = np.zeros((len(TERMS), len(self.channels), H, W))
        mean, m2 = np.zeros(C), np.zeros(C)
        for c, field in enumerate(channel_fields(x)):
            if c < C:
                mean[c] = field.mean()
                m2[c] = np.square(field - mean[c]).sum()
            self.xty[:, c] += np.tensordot(design, field, axes=([0], [0]))
        self._merge_moments(self.count * H * W, B * H * W, mean, m2)
        self.xtx += design.T @ design
        self.count += B

    def _merge_moments(self, n_a: int, n_b: int, mean_b: np.ndarray, m2_b: np.ndarray
                       ) -> None:
        n = n_a + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / n)
        self.m2 = self.m2 + m2_b + delta**2 * (n_a * n_b / n)

    def merge(self, other: PartialSums) -> PartialSums:
        """These sums plus `other`'s (both of the same grid and channels), added into these
        sums' arrays (a merge of many years holds two years' sums at once); returns them."""
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        pixels = self.xty.shape[2] * self.xty.shape[3]
        self.xtx += other.xtx
        self.xty += other.xty
        self._merge_moments(self.count * pixels, other.count * pixels, other.mean, other.m2)
        self.count += other.count
        return self

    # ------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike) -> None:
        """One .npz, written under a temporary name and renamed when complete."""
        save_npz(path, count=np.int64(self.count), mean=self.mean, m2=self.m2, xtx=self.xtx,
                 xty=self.xty, channels=np.array(self.channels))

    @classmethod
    def load(cls, path: str | os.PathLike) -> PartialSums:
        with np.load(path) as f:
            return cls(int(f["count"]), f["mean"], f["m2"], f["xtx"], f["xty"],
                       tuple(str(c) for c in f["channels"]))

    # ------------------------------------------------------------------ results
    def means_and_stds(self) -> tuple[np.ndarray, np.ndarray]:
        """(1, C, 1, 1) float64 global means and population standard deviations."""
        pixels = self.xty.shape[2] * self.xty.shape[3]
        var = self.m2 / (self.count * pixels)
        return self.mean[None, :, None, None], np.sqrt(var)[None, :, None, None]

    def time_mean(self) -> np.ndarray:
        """(C', H, W) float64: the mean over samples of every grid point (the constant
        term's row of X^T Y divided by the number of samples)."""
        return self.xty[0] / self.count

    def harmonics(self) -> np.ndarray:
        """(T, C', H, W) float32 least-squares coefficients of the climatology, solved in
        float64 one channel at a time. Terms the samples cannot tell apart (a few days of
        data, not a year) get the minimum-norm solution instead of an error."""
        T = len(TERMS)
        inverse = np.linalg.pinv(self.xtx, rcond=1e-10)
        out = np.empty(self.xty.shape, dtype=np.float32)
        for c in range(self.xty.shape[1]):
            solved = inverse @ self.xty[:, c].reshape(T, -1)
            out[:, c] = solved.reshape(T, *out.shape[2:])
        return out


def write_stats(stats_dir: str | os.PathLike, sums: PartialSums, grid: Grid,
                rh_definition: str = "") -> list[Path]:
    """stats/global_means.npy, global_stds.npy, time_means.npy (float32, the tutorial's
    layout), climatology.npz (recording the definition of its relative humidity, if
    known: data/humidity.py), latitude.npy and longitude.npy; each written whole."""
    out = Path(stats_dir)
    out.mkdir(parents=True, exist_ok=True)
    means, stds = sums.means_and_stds()
    C = len(sums.mean)
    time_mean = sums.time_mean()
    for name, values in (("global_means", means), ("global_stds", stds),
                         ("time_means", time_mean[None, :C])):
        tmp = out / f"{name}.npy.tmp"
        with open(tmp, "wb") as f:
            np.save(f, values.astype(np.float32))
        os.replace(tmp, out / f"{name}.npy")
    save_climatology(out, sums.harmonics(), time_mean, sums.channels, sums.count,
                     rh_definition)
    save_stats_grid(out, grid)
    return [out / f"{n}" for n in ("global_means.npy", "global_stds.npy", "time_means.npy",
                                  "climatology.npz", "latitude.npy", "longitude.npy")]


# ----------------------------------------------------------------- reading them back

def _read_npy(path: str, name: str, mmap_mode: str | None = None) -> np.ndarray:
    if not os.path.isfile(path):
        raise DataError(f"statistics file {path} not found")
    try:
        return np.load(path, mmap_mode=mmap_mode)
    except (OSError, ValueError) as e:  # not an .npy file, truncated, a pickle
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{name} {path} is not a readable .npy file ({first})") from None


def first_bad(bad: np.ndarray) -> tuple[int, int]:
    """(first channel with a True in `bad` (C, ...), how many there)."""
    per_channel = bad.reshape(bad.shape[0], -1).sum(axis=1)
    c = int(np.flatnonzero(per_channel)[0])
    return c, int(per_channel[c])


def nan_or_inf(values: np.ndarray) -> str:
    """'NaN' if `values` hold one, else 'inf' (of values known not all finite)."""
    return "NaN" if np.isnan(values).any() else "inf"


def check_stats(stats: np.ndarray, path: str, name: str, positive: bool = False) -> np.ndarray:
    """`stats` (1, C, ...) as float32 if every value is finite there (and > 0 with
    `positive`); otherwise a DataError naming the file and the first bad channel."""
    with np.errstate(over="ignore"):  # a float64 beyond float32's range: inf, caught below
        stats = stats.astype(np.float32)
    values = stats[0]
    bad = ~np.isfinite(values)
    if bad.any():
        c, n = first_bad(bad)
        raise DataError(f"{name} {path}: {channel_label(c)} has {n} {nan_or_inf(values[c])} "
                        "value(s); every statistic must be finite")
    if positive and (values <= 0).any():
        c, n = first_bad(values <= 0)
        raise DataError(f"{name} {path}: {channel_label(c)} is {float(values[c].min()):g}; "
                        "a standard deviation must be > 0 (a constant channel cannot be "
                        "normalised)")
    return stats


def load_stats(path: str, channels: int, name: str) -> np.ndarray:
    """The first `channels` of a (1, C, 1, 1) or (1, C, H, W) statistics file, every value
    finite; anything else is a one-line DataError naming the file."""
    stats = _read_npy(path, name)
    if stats.ndim != 4 or stats.shape[0] != 1 or stats.shape[1] < channels:
        raise DataError(f"{name} {path} has shape {stats.shape}, "
                        f"expected (1, {channels}, 1, 1) or (1, {channels}, H, W)")
    return check_stats(stats[:, :channels], path, name)


def load_stds(path: str, channels: int) -> np.ndarray:
    """The global standard deviations: `load_stats`, and every one > 0."""
    return check_stats(load_stats(path, channels, "global stds"), path, "global stds",
                       positive=True)


def stats_grid(cfg: Config) -> Grid:
    """The data set's grid as recorded beside its statistics (stats/latitude.npy,
    longitude.npy), or assumed from the shape of time_means.npy."""
    path = cfg.time_means_path
    shape = _read_npy(path, "time means", mmap_mode="r").shape
    if len(shape) != 4:
        raise DataError(f"time means {path} has shape {shape}, expected (1, C, H, W)")
    return load_stats_grid(os.path.dirname(path), shape[2:])


def score_grid(cfg: Config) -> Grid:
    """The grid the config reads and scores: the data set's, cropped to `img_size`."""
    return crop_to(stats_grid(cfg), cfg.img_size, os.path.dirname(cfg.time_means_path))
