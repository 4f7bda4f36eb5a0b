"""The grid of a data set: the latitude of every row and the longitude of every column.

A data set records its grid (degrees) as datasets `latitude` (H,) and `longitude` (W,) in
every year file, and as stats/latitude.npy and stats/longitude.npy beside the statistics.
Rows run north to south. Files written before grids were recorded (the tutorial's own
HDF5 files) are read with the tutorial's grid (`tutorial_grid`: ERA5's rows from the north
pole, columns from 0 degrees east), and the log says so once.

A config's `img_size` smaller than the data's grid is a crop of the first rows (north to
south) and columns, stated once in the log with the latitudes and longitudes it keeps; the
scores then weight the rows that are kept. Larger than the grid is a DataError.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from utils.errors import DataError

log = logging.getLogger(__name__)

LATITUDE, LONGITUDE = "latitude", "longitude"
_TOLERANCE = 1e-4  # degrees: grids closer than this are the same grid
_said: set[tuple] = set()  # notes already logged by this process


@dataclass(frozen=True, eq=False)
class Grid:
    """Latitudes (H,) and longitudes (W,) in degrees of a field's rows and columns.

    `parent_latitude` is the latitudes of the data's whole grid when this grid is a crop of
    its first rows (cell areas are those of the data's grid); `recorded` is False for a grid
    assumed from a file's shape."""

    latitude: np.ndarray
    longitude: np.ndarray
    recorded: bool = True
    parent_latitude: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.latitude), len(self.longitude)

    def same_as(self, other: Grid) -> bool:
        return (self.shape == other.shape
                and bool(np.allclose(self.latitude, other.latitude, atol=_TOLERANCE))
                and bool(np.allclose(self.longitude, other.longitude, atol=_TOLERANCE)))

    def describe(self) -> str:
        """'16 x 32, latitude 90.00 to -78.75, longitude 0.00 to 348.75'."""
        lat, lon = self.latitude, self.longitude
        return (f"{self.shape[0]} x {self.shape[1]}, latitude {lat[0]:.2f} to {lat[-1]:.2f}, "
                f"longitude {lon[0]:.2f} to {lon[-1]:.2f}")

    def crop(self, rows: int, cols: int) -> Grid:
        """The first `rows` rows and `cols` columns."""
        parent = self.latitude if self.parent_latitude is None else self.parent_latitude
        return Grid(self.latitude[:rows], self.longitude[:cols], self.recorded, parent)

    def cell_latitudes(self) -> np.ndarray:
        """The latitudes whose cells define the row areas: the data's whole grid."""
        return self.latitude if self.parent_latitude is None else self.parent_latitude


def tutorial_grid(h: int, w: int) -> Grid:
    """The grid assumed for a file that records none: an even number of rows at
    90 - 180 i / h (the tutorial's crop of ERA5: north pole included, south pole not), an odd
    number from pole to pole (ERA5's 721 rows); columns at 360 j / w."""
    step = 180.0 / (h - 1 if h % 2 and h > 1 else h)
    return Grid(90.0 - step * np.arange(h), 360.0 * np.arange(w) / w, recorded=False)


def agree(a: Grid, b: Grid) -> bool:
    """Whether two grids have the same first rows and columns (the smaller one is a crop of
    the larger, or they are the same)."""
    rows, cols = min(a.shape[0], b.shape[0]), min(a.shape[1], b.shape[1])
    return a.crop(rows, cols).same_as(b.crop(rows, cols))


def checked(latitude: np.ndarray, longitude: np.ndarray, where: str) -> Grid:
    """A Grid of 1-D, finite, strictly monotonic coordinates within range, else DataError."""
    lat = np.asarray(latitude, dtype=np.float64)
    lon = np.asarray(longitude, dtype=np.float64)
    for name, x, lo, hi in ((LATITUDE, lat, -90.0, 90.0), (LONGITUDE, lon, -360.0, 360.0)):
        if x.ndim != 1 or len(x) == 0 or not np.isfinite(x).all():
            raise DataError(f"{where}: {name} must be a 1-D array of finite degrees, "
                            f"got shape {x.shape}")
        if x.min() < lo - _TOLERANCE or x.max() > hi + _TOLERANCE:
            raise DataError(f"{where}: {name} {x.min():g} .. {x.max():g} is outside "
                            f"[{lo:g}, {hi:g}] degrees")
    if len(lat) > 1 and not (np.diff(lat) < 0).all():
        raise DataError(f"{where}: latitude must run from north to south (row 0 north), "
                        f"got {lat[0]:g} .. {lat[-1]:g}")
    if len(lon) > 1 and not (np.diff(lon) > 0).all():
        raise DataError(f"{where}: longitude must increase along the columns")
    return Grid(lat, lon)


# ------------------------------------------------------------------ HDF5 year files
def read_file_grid(f: Any, path: str, shape: tuple[int, int]) -> Grid:
    """The grid of an open h5py year file whose fields are `shape` (H, W): its recorded
    `latitude` / `longitude`, else the tutorial grid of that shape."""
    if LATITUDE not in f or LONGITUDE not in f:
        _note_once(("assumed", os.path.dirname(path)), f"{path} records no latitude/"
                   "longitude: assuming the tutorial's grid (data/grid.py)")
        return tutorial_grid(*shape)
    grid = checked(f[LATITUDE][()], f[LONGITUDE][()], path)
    if grid.shape != tuple(shape):
        raise DataError(f"{path}: latitude/longitude describe a {grid.shape[0]} x "
                        f"{grid.shape[1]} grid, the fields are {shape[0]} x {shape[1]}")
    return grid


def write_file_grid(f: Any, grid: Grid) -> None:
    """`latitude` and `longitude` datasets (degrees) in an open, writable h5py file."""
    for name, values in ((LATITUDE, grid.latitude), (LONGITUDE, grid.longitude)):
        ds = f.create_dataset(name, data=np.asarray(values, dtype=np.float64),
                              track_times=False)
        ds.attrs["units"] = "degrees_north" if name == LATITUDE else "degrees_east"


# ------------------------------------------------------------------ stats/
def save_stats_grid(stats_dir: str | os.PathLike, grid: Grid) -> None:
    """stats/latitude.npy and stats/longitude.npy (float64 degrees), each written whole."""
    for name, values in ((LATITUDE, grid.latitude), (LONGITUDE, grid.longitude)):
        path = os.path.join(stats_dir, f"{name}.npy")
        tmp = path + ".tmp"
        with open(tmp, "wb") as out:
            np.save(out, np.asarray(values, dtype=np.float64))
        os.replace(tmp, path)


def load_stats_grid(stats_dir: str | os.PathLike, shape: tuple[int, int]) -> Grid:
    """The grid beside the statistics of a (H, W) = `shape` data set; the tutorial grid of
    that shape when none is recorded there."""
    paths = [os.path.join(stats_dir, f"{n}.npy") for n in (LATITUDE, LONGITUDE)]
    if not all(os.path.isfile(p) for p in paths):
        _note_once(("assumed", str(stats_dir)), f"{stats_dir} records no latitude.npy/"
                   "longitude.npy: assuming the tutorial's grid (data/grid.py)")
        return tutorial_grid(*shape)
    try:
        lat, lon = (np.load(p) for p in paths)
    except (OSError, ValueError) as e:
        raise DataError(f"{stats_dir}: latitude.npy/longitude.npy are not readable .npy "
                        f"files ({str(e).splitlines()[0]})") from None
    grid = checked(lat, lon, str(stats_dir))
    if grid.shape != tuple(shape):
        raise DataError(f"{stats_dir}: latitude.npy/longitude.npy describe a "
                        f"{grid.shape[0]} x {grid.shape[1]} grid, time_means.npy is "
                        f"{shape[0]} x {shape[1]}")
    return grid


# ------------------------------------------------------------------ img_size
def crop_to(grid: Grid, img_size: tuple[int, int] | list[int], where: str) -> Grid:
    """The part of `grid` a config with `img_size` reads: the whole grid, or its first rows
    and columns (logged once), or a DataError if img_size is larger than the grid."""
    H, W = (int(n) for n in img_size)
    h, w = grid.shape
    if H > h or W > w:
        raise DataError(f"{where}: the data's grid is {h} x {w}, smaller than img_size "
                        f"{H} x {W}")
    if (H, W) == (h, w):
        return grid
    crop = grid.crop(H, W)
    lat, lon = crop.latitude, crop.longitude
    _note_once(("crop", h, w, H, W), f"img_size {H} x {W} crops the data's {h} x {w} grid "
               f"({where}) to its first {H} rows (latitude {lat[0]:.2f} to {lat[-1]:.2f}) "
               f"and {W} columns (longitude {lon[0]:.2f} to {lon[-1]:.2f}); scores weight "
               "the rows kept")
    return crop


def _note_once(key: tuple, message: str) -> None:
    if key not in _said:
        _said.add(key)
        log.warning(message)
