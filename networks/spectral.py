"""The AFNO's 2D real FFT on one device, keeping the modes hard thresholding keeps.

A token grid of H x W (rows = latitude, columns = longitude) with C channels, channels last:
rfft along W (keep the KW lowest modes), then fft along H (keep the KH lowest |modes|); the
inverse runs the same steps backwards, zeros in place of the dropped modes.

Mode truncation (AFNO's hard thresholding, fraction f of the modes per axis): along the
rfft axis keep k < KW = max(1, int(f (W//2 + 1))); along the full-FFT axis keep the rows
whose frequency min(k, H - k) < kh = max(1, int(f (H//2 + 1))), i.e. KH = min(H, 2 kh - 1)
rows: [0, kh) and [H - kh + 1, H). f = 1 keeps every mode.

`distributed.fft.RealFFT2` is the same transform with the grid split over the h x w mesh:
it fills in the four exchanges that are no-ops here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Modes:
    """The Fourier modes an (H, W) grid keeps: rows of frequency min(k, H - k) < kh along H
    (full FFT), columns k < kw along W (real FFT)."""

    grid: tuple[int, int]
    kh: int
    kw: int

    @property
    def rows(self) -> int:
        """Number of kept rows, KH."""
        return min(self.grid[0], 2 * self.kh - 1)


def kept_modes(grid: tuple[int, int], fraction: float = 1.0, fourcastnet: bool = False
               ) -> Modes:
    """The modes AFNO's hard thresholding keeps: `fraction` of each axis' frequencies.

    `fourcastnet`: the modes FourCastNet's published AFNO keeps (networks/afno.py,
    `afno_variant`): its code counts the kept modes of both axes from the rows, H // 2 + 1,
    so at fraction 1 it keeps every row but only the columns k < min(W // 2 + 1, H // 2 + 1)
    (46 of 91 on its 90 x 180 token grid). Below 1 it keeps a band of the highest row
    frequencies instead of the lowest: not reproduced, refused."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"hard_thresholding_fraction must be in (0, 1], got {fraction}")
    H, W = grid
    if fourcastnet:
        if fraction != 1.0:
            raise ValueError(f"FourCastNet's mode truncation is reproduced at "
                             f"hard_thresholding_fraction 1 only, got {fraction}")
        return Modes((H, W), H // 2 + 1, min(W // 2 + 1, H // 2 + 1))
    return Modes((H, W), max(1, int(fraction * (H // 2 + 1))),
                 max(1, int(fraction * (W // 2 + 1))))


def compact_rows(spec: torch.Tensor, modes: Modes) -> torch.Tensor:
    """(B, H, ...) full-FFT rows -> (B, KH, ...) kept rows (lowest |frequency|)."""
    if modes.rows == modes.grid[0]:
        return spec
    kh = modes.kh
    return torch.cat([spec[:, :kh], spec[:, spec.shape[1] - (modes.rows - kh):]], dim=1)


def expand_rows(spec: torch.Tensor, modes: Modes) -> torch.Tensor:
    """Inverse of `compact_rows`: zeros in place of the dropped rows."""
    H, kh = modes.grid[0], modes.kh
    if modes.rows == H:
        return spec
    zeros = spec.new_zeros((spec.shape[0], H - modes.rows, *spec.shape[2:]))
    return torch.cat([spec[:, :kh], zeros, spec[:, kh:]], dim=1)


# ------------------------------------------------------------------------- transform

class RealFFT2:
    """rfft2 / irfft2 (norm "ortho", dims 1 and 2 of channels-last grids) keeping `modes`,
    on one device. The four exchange steps are where a split grid talks to other ranks."""

    def __init__(self, modes: Modes, channels: int):
        self.modes = modes
        self.tile = modes.grid  # this rank's part of the grid: all of it
        self.channels = slice(0, channels)  # ...and of the spectrum's channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Real grid (B, H, W, C) -> complex spectrum (B, KH, KW, C)."""
        x = self._gather_columns(x)
        s = torch.fft.rfft(x, dim=2, norm="ortho")[:, :, : self.modes.kw]
        s = self._gather_rows(s)
        return compact_rows(_fft_rows(s, torch.fft.fft), self.modes)

    def inverse(self, s: torch.Tensor) -> torch.Tensor:
        """Complex spectrum (B, KH, KW, C) -> real grid (B, H, W, C)."""
        s = _fft_rows(expand_rows(s, self.modes), torch.fft.ifft)
        s = self._scatter_rows(s)
        # irfft zero-pads the dropped column modes up to W//2 + 1 itself
        x = torch.fft.irfft(s, n=self.modes.grid[1], dim=2, norm="ortho")
        return self._scatter_columns(x)

    # One device: every row and column is here already.
    def _gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _gather_rows(self, s: torch.Tensor) -> torch.Tensor:
        return s

    def _scatter_rows(self, s: torch.Tensor) -> torch.Tensor:
        return s

    def _scatter_columns(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _fft_rows(s: torch.Tensor, fft: Any) -> torch.Tensor:
    """(i)fft along dim 1. A rank may hold no column mode at all (3 kept over h = 4), and
    MKL rejects empty transforms: the empty tensor passes through, still in the autograd
    graph, so this rank's backward still joins the all-to-alls of the others."""
    return fft(s, dim=1, norm="ortho") if s.numel() else s
