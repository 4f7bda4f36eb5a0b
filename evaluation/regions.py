"""Latitude weights and regions, as WeatherBench-2 defines them.

Weights: the area of each row's cell on the sphere, from the latitudes the data records
(data/grid.py). A row's cell spans from the midpoint to its neighbour on either side;
the first and last rows' cells reach the poles. Its area is proportional to
sin(upper bound) - sin(lower bound), and the weights are normalised to mean 1 over the rows
scored (WeatherBench-2's `get_lat_weights`, which needs latitudes in ascending order; here
they are sorted first, so rows may run north to south as in the tutorial's files). A grid
cropped by `img_size` keeps the cell areas of the data's whole grid for the rows it keeps.

Regions (WeatherBench-2's names and latitude bands, bounds included): global,
northern-hemisphere (20 to 90 N, the northern extratropics), tropics (20 S to 20 N) and
southern-hemisphere (90 to 20 S). A regional mean is the weighted mean over the rows of
the band (every longitude): the weights of the band's rows divided by their sum. A band
without rows on the grid (a crop of the north) is not scored.
"""

from __future__ import annotations

import numpy as np
import torch

from data.grid import Grid

REGIONS: tuple[tuple[str, float, float], ...] = (
    ("global", -90.0, 90.0),
    ("northern-hemisphere", 20.0, 90.0),
    ("tropics", -20.0, 20.0),
    ("southern-hemisphere", -90.0, -20.0),
)


def cell_areas(latitude: np.ndarray) -> np.ndarray:
    """Relative cell area of each row of latitudes (degrees, any monotonic order)."""
    lat = np.deg2rad(np.asarray(latitude, dtype=np.float64))
    order = np.argsort(lat)
    ascending = lat[order]
    bounds = np.concatenate([[-np.pi / 2], (ascending[:-1] + ascending[1:]) / 2, [np.pi / 2]])
    areas = np.empty_like(lat)
    areas[order] = np.sin(bounds[1:]) - np.sin(bounds[:-1])
    return areas


def latitude_weights(grid: Grid) -> np.ndarray:
    """(H,) float64 weights of the grid's rows, mean 1 (module docstring)."""
    areas = cell_areas(grid.cell_latitudes())[:grid.shape[0]]
    return areas / areas.mean()


def region_weights(grid: Grid) -> tuple[list[str], np.ndarray]:
    """(names of the regions with rows on the grid, (R, H) float64 weights): region r's
    weights are the cell areas of its rows scaled to sum to H, zero elsewhere, so that
    sum(w_r * x) / (H * W) is the region's weighted mean of x (H, W)."""
    areas = latitude_weights(grid)
    lat = grid.latitude
    names, rows = [], []
    for name, south, north in REGIONS:
        inside = (lat >= south) & (lat <= north)
        if inside.any():
            w = np.where(inside, areas, 0.0)
            names.append(name)
            rows.append(w * len(lat) / w.sum())
    return names, np.stack(rows)


def weights_tensor(grid: Grid, device: torch.device | str = "cpu",
                   regions: bool = True) -> tuple[list[str], torch.Tensor]:
    """`region_weights` as float32 on `device`; regions=False: only the global row, (1, H)."""
    names, w = region_weights(grid)
    if not regions:
        names, w = names[:1], w[:1]
    return names, torch.from_numpy(w).to(device=device, dtype=torch.float32)
