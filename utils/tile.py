"""Which part of the global grid a rank's fields cover.

One device, DDP and tensor/context parallelism: every rank holds the whole `img_size`
field. Spatial parallelism (AFNO on the h x w mesh): each rank holds a tile, a block of
rows (latitudes) and columns (longitudes); the ranks of the "h-w" group hold the others.
The loaders read only the tile, and the skill scores sum over it and then over "h-w".

    tile = Tile.whole((64, 128))                          # the default
    tile = Tile((64, 128), slice(32, 64), slice(0, 64))   # rank (1, 0) of a 2 x 2 mesh
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tile:
    """Pixel rows and columns of the global (H, W) = `grid` field held by this rank."""

    grid: tuple[int, int]
    rows: slice
    cols: slice

    @classmethod
    def whole(cls, grid: tuple[int, int] | list[int]) -> Tile:
        H, W = (int(n) for n in grid)
        return cls((H, W), slice(0, H), slice(0, W))

    def __post_init__(self) -> None:
        for s, n, what in ((self.rows, self.grid[0], "rows"), (self.cols, self.grid[1], "cols")):
            if s.step not in (None, 1) or not 0 <= s.start < s.stop <= n:
                raise ValueError(f"tile {what} {s} is not a non-empty block of [0, {n})")

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, columns) of the tile."""
        return self.rows.stop - self.rows.start, self.cols.stop - self.cols.start

    @property
    def is_whole(self) -> bool:
        return self.shape == self.grid
