"""The distributed 2D real FFT (distributed.fft) against torch.fft on one process.

Forward: the grid (B, H, W, C) is split into tiles over h x w; each rank's spectrum tile
must equal its part (kept rows; its h chunk of the kept columns; its w chunk of the
channels) of torch.fft.rfft2 of the whole grid, truncated. Gradients: the backward of a
random linear functional of the output, on the tile against the serial one. Inverse: the
same with torch.fft.irfft2 of the zero-filled spectrum. 7 x 10 tokens and 5 channels split
unevenly on every layout; fraction 0.5 keeps 3 of 7 rows and 3 of 6 columns (on h = 4 one
rank holds no column at all).

Tolerance: max |err| <= 1e-5 x max |serial| per tensor. The distributed transform runs the
same 1D FFTs as torch's 2D one in another order and on other batch shapes; fp32 FFT
round-off on these sizes is ~1e-7 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close_rel, kept_rows, run_distributed

from distributed import comm
from distributed.fft import (
    RealFFT2,
    alltoall_bytes,
    balanced_split,
    kept_modes,
    transpose,
)
from distributed.helpers import compute_split_shapes

RTOL = 1e-5
GRID, CHANNELS, BATCH = (7, 10), 5, 2


def _chunk(x: torch.Tensor, dim: int, sizes: list[int], index: int) -> torch.Tensor:
    return x.split(sizes, dim=dim)[index]


def _grid_tile(x: torch.Tensor, fft: RealFFT2) -> torch.Tensor:
    """This rank's (B, H_i, W_j, C) tile of a whole grid."""
    x = _chunk(x, 1, fft.rows, comm.get_rank("h"))
    return _chunk(x, 2, fft.cols, comm.get_rank("w"))


def _spectrum_tile(s: torch.Tensor, fft: RealFFT2) -> torch.Tensor:
    """This rank's (B, KH, KW_i, C_j) tile of a whole truncated spectrum."""
    return s[:, :, fft.kw, fft.channels]


def _serial_spectrum(x: torch.Tensor, fraction: float) -> torch.Tensor:
    """torch.fft.rfft2 truncated the independent way: by global index lists."""
    modes = kept_modes(GRID, fraction)
    H = GRID[0]
    rows = [k for k in range(H) if min(k, H - k) < modes.kh]  # |frequency| < kh
    return torch.fft.rfft2(x, dim=(1, 2), norm="ortho")[:, rows, : modes.kw]


def _serial_inverse(s: torch.Tensor, fraction: float) -> torch.Tensor:
    modes = kept_modes(GRID, fraction)
    full = torch.zeros(BATCH, GRID[0], GRID[1] // 2 + 1, CHANNELS, dtype=s.dtype)
    full[:, kept_rows(modes), : modes.kw] = s
    return torch.fft.irfft2(full, s=GRID, dim=(1, 2), norm="ortho")


def _check_forward(fft: RealFFT2, fraction: float, where: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, *GRID, CHANNELS, generator=g, requires_grad=True)
    spec = _serial_spectrum(x, fraction)
    probe = torch.randn(spec.shape, dtype=spec.dtype, generator=g)  # random linear functional
    (spec * probe.conj()).real.sum().backward()

    x_tile = _grid_tile(x.detach(), fft).clone().requires_grad_()
    spec_tile = fft.forward(x_tile)
    assert_close_rel(spec_tile, _spectrum_tile(spec.detach(), fft), f"{where} rfft2", RTOL)
    (spec_tile * _spectrum_tile(probe, fft).conj()).real.sum().backward()
    assert_close_rel(x_tile.grad, _grid_tile(x.grad, fft), f"{where} rfft2 input gradient", RTOL)


def _check_inverse(fft: RealFFT2, fraction: float, where: str) -> None:
    g = torch.Generator().manual_seed(2)
    modes = kept_modes(GRID, fraction)
    s = torch.randn(BATCH, modes.rows, modes.kw, CHANNELS, dtype=torch.complex64, generator=g)
    s.requires_grad_()
    out = _serial_inverse(s, fraction)
    probe = torch.randn(out.shape, generator=g)
    (out * probe).sum().backward()

    s_tile = _spectrum_tile(s.detach(), fft).clone().requires_grad_()
    out_tile = fft.inverse(s_tile)
    assert_close_rel(out_tile, _grid_tile(out.detach(), fft), f"{where} irfft2", RTOL)
    (out_tile * _grid_tile(probe, fft)).sum().backward()
    assert_close_rel(s_tile.grad, _spectrum_tile(s.grad, fft), f"{where} irfft2 spectrum gradient",
                     RTOL)


def _run_fft(h: int, w: int) -> None:
    comm.init(h=h, w=w)
    for fraction in (1.0, 0.5):
        fft = RealFFT2(kept_modes(GRID, fraction), CHANNELS, groups=("h", "w"))
        where = f"h={h} w={w} fraction={fraction}"
        _check_forward(fft, fraction, where)
        _check_inverse(fft, fraction, where)


@pytest.mark.distributed
@pytest.mark.parametrize("h,w", [(2, 1), (1, 2), (2, 2), (4, 1)], ids=lambda v: str(v))
def test_distributed_rfft2_and_irfft2_match_torch_values_and_gradients(h: int, w: int) -> None:
    run_distributed(_run_fft, h * w, h, w)


def test_serial_transform_is_torch_rfft2_then_truncation() -> None:
    comm.reset()
    for fraction in (1.0, 0.5, 0.3):
        fft = RealFFT2(kept_modes(GRID, fraction), CHANNELS)
        x = torch.randn(BATCH, *GRID, CHANNELS)
        assert_close_rel(fft.forward(x), _serial_spectrum(x, fraction), f"fraction {fraction}",
                         RTOL)
        s = fft.forward(x)
        assert_close_rel(fft.inverse(s), _serial_inverse(s, fraction),
                         f"inverse, fraction {fraction}", RTOL)
    full = RealFFT2(kept_modes(GRID), CHANNELS)  # fraction 1 keeps every mode: the round
    # trip is the identity
    assert_close_rel(full.inverse(full.forward(x)), x, "round trip", RTOL)


def test_kept_modes_are_the_lowest_frequencies_of_each_axis() -> None:
    modes = kept_modes((7, 10), 0.5)
    assert (modes.kh, modes.kw, modes.rows) == (2, 3, 3)
    assert kept_rows(modes) == [0, 1, 6]  # frequencies 0, 1, -1
    assert kept_rows(kept_modes((8, 16), 1.0)) == list(range(8))
    assert kept_modes((8, 16), 1.0).kw == 9
    with pytest.raises(ValueError, match="hard_thresholding_fraction"):
        kept_modes((8, 16), 0.0)
    assert balanced_split(3, 4) == [1, 1, 1, 0]


# ------------------------------------------------------------------ the all-to-all itself

def _run_transpose() -> None:
    """Over a group of 3 (uneven: 7 rows, 5 channels), the all-to-all equals slicing the
    global tensor, and autograd's backward equals the reverse all-to-all of the gradient:
    checked against the serial gradient and as the adjoint identity <Ax, g> = <x, A^T g>."""
    comm.init(w=3)
    rank, rows, chans = comm.get_rank("w"), compute_split_shapes(7, 3), [2, 2, 1]
    g = torch.Generator().manual_seed(3)
    full = torch.randn(2, 7, 5, dtype=torch.complex64, generator=g)  # (B, rows, channels)
    probe = torch.randn(2, 7, 5, dtype=torch.complex64, generator=g)
    x = _chunk(full, 1, rows, rank).clone().requires_grad_()  # rows split, channels whole
    y = transpose(x, "w", 2, 1, chans, rows)  # -> channels split, rows whole
    assert torch.equal(y.detach(), _chunk(full, 2, chans, rank))
    gy = _chunk(probe, 2, chans, rank)
    (y * gy.conj()).real.sum().backward()
    assert torch.equal(x.grad, _chunk(probe, 1, rows, rank))  # d/dx Re<y, g> = g, sliced
    assert torch.equal(x.grad, transpose(gy, "w", 1, 2, rows, chans))  # the reverse transpose
    lhs = torch.stack([(y.detach() * gy.conj()).sum()])
    rhs = torch.stack([(x.detach() * x.grad.conj()).sum()])
    dist.all_reduce(lhs, group=comm.get_group("w"))
    dist.all_reduce(rhs, group=comm.get_group("w"))
    assert torch.allclose(lhs, rhs, rtol=1e-5)


@pytest.mark.distributed
def test_alltoall_backward_is_the_reverse_alltoall() -> None:
    run_distributed(_run_transpose, 3)


def _run_count_bytes(h: int, w: int, fraction: float) -> int:
    """Bytes this rank hands to all_to_all_single for other ranks in one forward and one
    inverse transform."""
    comm.init(h=h, w=w)
    sent = []
    original = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                 async_op=False):
        me = dist.get_group_rank(group, dist.get_rank())
        others = sum(n for r, n in enumerate(input_split_sizes) if r != me)
        sent.append(others * input.element_size())
        return original(output, input, output_split_sizes, input_split_sizes, group, async_op)

    dist.all_to_all_single = counting
    try:
        fft = RealFFT2(kept_modes(GRID, fraction), CHANNELS, groups=("h", "w"))
        x = torch.randn(BATCH, *fft.tile, CHANNELS)
        fft.inverse(fft.forward(x))
    finally:
        dist.all_to_all_single = original
    return sum(sent)


@pytest.mark.distributed
def test_alltoall_bytes_formula_counts_what_is_sent() -> None:
    for fraction in (1.0, 0.5):
        counted = sum(run_distributed(_run_count_bytes, 4, 2, 2, fraction))
        expected = alltoall_bytes(BATCH, kept_modes(GRID, fraction), CHANNELS, (2, 2))
        assert counted == expected, f"fraction {fraction}: counted {counted}, formula {expected}"
