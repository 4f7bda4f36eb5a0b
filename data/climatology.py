"""A seasonal and diurnal climatology in a few numbers per grid point.

WeatherBench-2's climatology is a table by day of year x hour of day: at 0.25 degrees and
6-hourly, 366 x 4 fields of every variable, ~30 GB for the tutorial's 20 channels. A
smoothed seasonal cycle fits in a handful of harmonics instead: per channel and grid point,
a least-squares fit over the training years of

    c(p, h) = a0 + sum_{k=1..3} [a_k cos(2 pi k p) + b_k sin(2 pi k p)]         seasonal
                 + d1c cos(2 pi h/24) + d1s sin(2 pi h/24) + d2c cos(4 pi h/24)  diurnal
                 + (d1c, d1s) x (cos, sin)(2 pi p)                               its season

where p is the fraction of the year (sample i of a year of n samples: i / n) and h the hour
of day (UTC). The three diurnal terms represent the four 6-hourly times exactly; the four
products let the daily cycle grow and shrink with the seasons. 14 numbers per channel and
grid point, 14 x time_means.npy.

It is not WeatherBench-2's climatology, in two ways (docs/scoring.md has the numbers):
the smoothing, three annual harmonics kept whole and every faster cycle dropped, where
WeatherBench-2 smooths day of year with triangular window weights (faster cycles damped,
not removed; the slow ones damped a little); and the base period, the training years,
where WeatherBench-2 averages 1990-2019. ACC and the climatology baseline measured against
it differ from WeatherBench-2's by both; `inference.py --climatology` measures them against
WeatherBench-2's store instead (evaluation/wb2_climatology.py).

Stored as stats/climatology.npz: `coefficients` (14, C, H, W) float32 in physical units,
`time_mean` (C, H, W), `channels` (the 20 channels plus derived ones such as ws10, 10 m
wind speed), `terms`, `n_samples`, `rh_definition` (which relative humidity the data holds,
data/humidity.py; empty when not known). Its fit: data/statistics.py.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass

import numpy as np

from utils.errors import DataError

TERMS = ("1", "cos(1y)", "sin(1y)", "cos(2y)", "sin(2y)", "cos(3y)", "sin(3y)",
         "cos(1d)", "sin(1d)", "cos(2d)",
         "cos(1d)cos(1y)", "cos(1d)sin(1y)", "sin(1d)cos(1y)", "sin(1d)sin(1y)")
FILE_NAME = "climatology.npz"


def basis(phase: np.ndarray, hour: np.ndarray) -> np.ndarray:
    """(..., 14) float64 values of TERMS at year fraction `phase` and UTC `hour`."""
    y = 2 * np.pi * np.asarray(phase, dtype=np.float64)
    d = 2 * np.pi * np.asarray(hour, dtype=np.float64) / 24.0
    cd, sd = np.cos(d), np.sin(d)
    cy, sy = np.cos(y), np.sin(y)
    return np.stack([np.ones_like(y), cy, sy, np.cos(2 * y), np.sin(2 * y), np.cos(3 * y),
                     np.sin(3 * y), cd, sd, np.cos(2 * d), cd * cy, cd * sy, sd * cy, sd * sy],
                    axis=-1)


def sample_times(time_hours: np.ndarray, samples_per_year: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(year fraction, hour of day) of the samples of one year file, given their times in
    hours since 1970-01-01 and the number of samples in the whole year (1460 or 1464; a
    synthetic "year" holds one seasonal cycle)."""
    index = np.arange(len(time_hours), dtype=np.float64)
    return index / samples_per_year, np.mod(np.asarray(time_hours, dtype=np.float64), 24.0)


@dataclass(frozen=True)
class Climatology:
    """The fitted harmonics of a data set (module docstring), for the grid of `img_size`."""

    coefficients: np.ndarray | None  # (14, C, H, W) float32, physical units (None: not read)
    time_mean: np.ndarray     # (C, H, W) float32
    channels: tuple[str, ...]
    path: str
    rh_definition: str = ""   # of its relative humidity, data/humidity.py ("": not recorded)

    def at(self, phase: np.ndarray, hour: np.ndarray) -> np.ndarray:
        """(..., C, H, W) float32 climatology at year fractions `phase` (...) and `hour`."""
        assert self.coefficients is not None, "loaded without its coefficients"
        b = basis(phase, hour).astype(np.float32)
        return np.tensordot(b, self.coefficients, axes=([-1], [0]))


def save_npz(path: str | os.PathLike, **arrays: np.ndarray) -> None:
    """np.savez, byte for byte the same for the same arrays (no time stamps), written
    under a temporary name and renamed when complete."""
    tmp = f"{path}.tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, value in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            with z.open(info, "w", force_zip64=True) as out:
                np.lib.format.write_array(out, np.asanyarray(value), allow_pickle=False)
    os.replace(tmp, path)


def save_climatology(stats_dir: str | os.PathLike, coefficients: np.ndarray,
                     time_mean: np.ndarray, channels: tuple[str, ...], n_samples: int,
                     rh_definition: str = "") -> str:
    """Write stats/climatology.npz whole (a temporary file renamed); returns its path."""
    path = os.path.join(stats_dir, FILE_NAME)
    save_npz(path, coefficients=coefficients.astype(np.float32, copy=False),
             time_mean=time_mean.astype(np.float32), channels=np.array(channels),
             terms=np.array(TERMS), n_samples=np.int64(n_samples),
             rh_definition=np.array(rh_definition))
    return path


def load_climatology(stats_dir: str | os.PathLike, img_size: tuple[int, int] | list[int],
                     coefficients: bool = True) -> Climatology | None:
    """The data set's climatology cropped to `img_size` (without its coefficients for
    `coefficients=False`: the time mean alone, 1 / 14 of the file); None if it has none
    (data prepared before it existed: the evaluation then uses time_means alone)."""
    path = os.path.join(stats_dir, FILE_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with np.load(path) as f:
            time_mean = f["time_mean"]
            channels, terms = tuple(str(c) for c in f["channels"]), tuple(f["terms"])
            definition = str(f["rh_definition"]) if "rh_definition" in f.files else ""
            coef = f["coefficients"] if coefficients else None
            shape = coef.shape if coef is not None else (len(terms), *time_mean.shape)
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"{path} is not a readable climatology "
                        f"({str(e).splitlines()[0]})") from None
    H, W = (int(n) for n in img_size)
    if tuple(str(t) for t in terms) != TERMS or len(shape) != 4:
        raise DataError(f"{path}: unknown climatology terms {terms}; prepare the data again")
    if shape[2] < H or shape[3] < W:
        raise DataError(f"{path} is {shape[2]} x {shape[3]}, smaller than img_size {H} x {W}")
    return Climatology(None if coef is None else np.ascontiguousarray(coef[:, :, :H, :W]),
                       np.ascontiguousarray(time_mean[:, :H, :W]), channels, path,
                       definition)
