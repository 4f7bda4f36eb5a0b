"""The 2D real FFT of the AFNO filter over the spatial mesh (h x w).

A token grid of H x W (rows = latitude, columns = longitude) with C channels, channels last.
On the mesh, rank (i, j) holds rows chunk i (over the "h" group) and columns chunk j (over
"w"); chunks follow `compute_split_shapes`, so uneven splits (45 rows over 4 ranks) work.

    grid tile       (B, H_i, W_j, C)      rows split over h, columns over w
    spectrum tile   (B, KH, KW_i, C_j)    all kept row modes; the kept column modes split
                                          over h; the channels split over w

Forward (2 all-to-alls; an all-to-all is a transpose of the mesh: one axis is gathered,
another one is split):

    (B, H_i, W_j, C)  --all-to-all over w: gather W, split C-->  (B, H_i, W, C_j)
    rfft along W (now local), keep the KW lowest modes          (B, H_i, KW, C_j)
    --all-to-all over h: gather H, split KW-->                  (B, H, KW_i, C_j)
    fft along H (now local), keep the KH lowest |modes|         (B, KH, KW_i, C_j)

The inverse runs the same steps backwards (zeros in place of the dropped modes). Why the
spectrum keeps its channels split: the AFNO's spectral MLP acts on each frequency alone and
is block-diagonal over channels, so it runs on any tile that holds whole channel blocks
(callers pass block-aligned `channel_sizes`). Bringing the channels back together would cost
two more all-to-alls per transform. Truncating before the second all-to-all also means the
dropped column modes are never sent.

Mode truncation is networks/spectral.py's (the serial transform this one extends). Each
rank knows which global modes it holds from the split sizes alone: nothing is gathered to
truncate.

Communication (gloo and NCCL both take uneven `all_to_all_single` splits; complex tensors
are sent as (real, imag) pairs by torch). Per forward transform, rank (i, j) sends
    over w: (w-1)/w of its real tile         ~ B H_i W_j C (w-1)/w    x 4 bytes (fp32)
    over h: (h-1)/h of its complex pencil    ~ B H_i KW C_j (h-1)/h   x 8 bytes (complex64)
and the inverse the same amounts; autograd's backward of each all-to-all is the reverse
all-to-all, which moves the same bytes again. `alltoall_bytes` gives the exact total.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from distributed import comm
from distributed.helpers import compute_split_shapes
from networks import spectral
from networks.spectral import Modes, kept_modes  # noqa: F401 - also this module's API


def balanced_split(size: int, num_chunks: int) -> list[int]:
    """Like `compute_split_shapes`, but a chunk may be empty (3 kept modes over 4 ranks)."""
    base, extra = divmod(size, num_chunks)
    return [base + 1 if i < extra else base for i in range(num_chunks)]


# ---------------------------------------------------------------------------- all-to-all

def _exchange(x: torch.Tensor, group_name: str, split_dim: int, cat_dim: int,
              split_sizes: Sequence[int], cat_sizes: Sequence[int]) -> torch.Tensor:
    """Send chunk r of `split_dim` to rank r; concatenate what arrives along `cat_dim`."""
    world, rank = comm.get_size(group_name), comm.get_rank(group_name)
    if x.shape[split_dim] != sum(split_sizes) or x.shape[cat_dim] != cat_sizes[rank]:
        raise ValueError(f"all-to-all over {group_name}: tensor {tuple(x.shape)} does not fit "
                         f"split sizes {list(split_sizes)} (dim {split_dim}) and "
                         f"{list(cat_sizes)} (dim {cat_dim}) on rank {rank}")
    # split_dim first: each destination's chunk is then one contiguous run of memory
    send = x.movedim(split_dim, 0).contiguous()
    row = math.prod(send.shape[1:])
    moved_cat = cat_dim + 1 if cat_dim < split_dim else cat_dim
    shapes = []
    for r in range(world):  # what rank r sends me: my split chunk, its cat chunk
        shape = list(send.shape)
        shape[0], shape[moved_cat] = split_sizes[rank], cat_sizes[r]
        shapes.append(shape)
    counts = [math.prod(s) for s in shapes]
    recv = send.new_empty(sum(counts))
    dist.all_to_all_single(recv, send.reshape(-1), output_split_sizes=counts,
                           input_split_sizes=[n * row for n in split_sizes],
                           group=comm.get_group(group_name))
    pieces = [p.view(s) for p, s in zip(recv.split(counts), shapes, strict=True)]
    return torch.cat(pieces, dim=moved_cat).movedim(0, split_dim)


class _Transpose(torch.autograd.Function):
    """All-to-all transpose; its backward is the reverse transpose (a permutation of the
    elements across ranks, so the reverse is its exact adjoint)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str, split_dim: int, cat_dim: int,
                split_sizes: list[int], cat_sizes: list[int]) -> torch.Tensor:
        ctx.reverse = (group_name, cat_dim, split_dim, cat_sizes, split_sizes)
        return _exchange(x, group_name, split_dim, cat_dim, split_sizes, cat_sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _exchange(grad, *ctx.reverse), None, None, None, None, None


def transpose(x: torch.Tensor, group_name: str | None, split_dim: int, cat_dim: int,
              split_sizes: Sequence[int], cat_sizes: Sequence[int]) -> torch.Tensor:
    """Differentiable all-to-all over `group_name`: `x` holds all of `split_dim` and this
    rank's chunk of `cat_dim`; the result holds this rank's chunk of `split_dim`
    (`split_sizes`) and all of `cat_dim` (the ranks' chunks `cat_sizes`, in rank order).
    The identity on one rank (`group_name` None or of size 1)."""
    if group_name is None or comm.get_size(group_name) == 1:
        return x
    split_dim, cat_dim = split_dim % x.dim(), cat_dim % x.dim()
    return _Transpose.apply(x, group_name, split_dim, cat_dim, list(split_sizes),
                            list(cat_sizes))


# ------------------------------------------------------------------------- transform

class RealFFT2(spectral.RealFFT2):
    """networks.spectral.RealFFT2 on the h x w mesh: tiles in, spectrum tiles out.

    `groups` = (h group, w group): the mesh the grid is split over; (None, None) is one
    device, where the all-to-alls vanish (the serial transform).
    `channel_sizes`: how the spectrum's channels are split over w (default: balanced).
    """

    def __init__(self, modes: Modes, channels: int, channel_sizes: Sequence[int] | None = None,
                 groups: tuple[str | None, str | None] = (None, None)):
        super().__init__(modes, channels)
        self.h_group, self.w_group = groups
        nh, nw = (comm.get_size(g) if g is not None else 1 for g in groups)
        ih, iw = (comm.get_rank(g) if g is not None else 0 for g in groups)
        H, W = modes.grid
        self.rows, self.cols = compute_split_shapes(H, nh), compute_split_shapes(W, nw)
        self.kw_sizes = balanced_split(modes.kw, nh)
        self.channel_sizes = list(channel_sizes or balanced_split(channels, nw))
        if (sum(self.channel_sizes) != channels or len(self.channel_sizes) != nw
                or min(self.channel_sizes) < 1):
            raise ValueError(f"channel_sizes {self.channel_sizes} do not split {channels} "
                             f"channels over {nw} ranks, at least one each")
        self.tile = (self.rows[ih], self.cols[iw])  # this rank's part of the grid
        start = sum(self.channel_sizes[:iw])
        self.channels = slice(start, start + self.channel_sizes[iw])  # ...of the spectrum
        start = sum(self.kw_sizes[:ih])
        self.kw = slice(start, start + self.kw_sizes[ih])

    # (B, H_i, W_j, C) <-> (B, H_i, W, C_j): over w, gather the columns, split the channels
    def _gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        return transpose(x, self.w_group, 3, 2, self.channel_sizes, self.cols)

    def _scatter_columns(self, x: torch.Tensor) -> torch.Tensor:
        return transpose(x, self.w_group, 2, 3, self.cols, self.channel_sizes)

    # (B, H_i, KW, C_j) <-> (B, H, KW_i, C_j): over h, gather the rows, split the kept columns
    def _gather_rows(self, s: torch.Tensor) -> torch.Tensor:
        return transpose(s, self.h_group, 2, 1, self.kw_sizes, self.rows)

    def _scatter_rows(self, s: torch.Tensor) -> torch.Tensor:
        return transpose(s, self.h_group, 1, 2, self.rows, self.kw_sizes)


def alltoall_bytes(batch: int, modes: Modes, channels: int, mesh: tuple[int, int],
                   channel_sizes: Sequence[int] | None = None, real_bytes: int = 4) -> int:
    """Bytes all ranks together send to other ranks in one forward + inverse transform
    (a round trip); the backward of that pair moves the same amount again.

    Over w, every (row, column, channel) value not kept by its sender crosses once per
    direction: the real grid B H W C, minus the part whose channel chunk stays home.
    Over h, the complex pencil B H KW C likewise. Uneven splits are counted exactly.
    """
    H, W = modes.grid
    nh, nw = mesh
    rows, cols = compute_split_shapes(H, nh), compute_split_shapes(W, nw)
    chans = list(channel_sizes or balanced_split(channels, nw))
    kws = balanced_split(modes.kw, nh)
    stay_w = sum(r * c * ch for r in rows for c, ch in zip(cols, chans, strict=True))
    stay_h = sum(r * k for r, k in zip(rows, kws, strict=True)) * channels
    over_w = (H * W * channels - stay_w) * real_bytes
    over_h = (H * modes.kw * channels - stay_h) * 2 * real_bytes
    return 2 * batch * (over_w + over_h)  # forward and inverse
