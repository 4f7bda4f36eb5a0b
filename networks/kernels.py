"""Kernels whose precision policy depends on the device, shared by every model and layout:
the serial ViT and the tensor/context-parallel attention call the same `attention`, so
`train.py` and `train_mp.py` compute alike.

`as_on("cuda")` makes them choose as on a GPU whatever device their tensors are on: the
memory planner (planning/memory.py) traces a GPU's step on fake CPU tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

# A module global, not a ContextVar: torch.compile traces a global read (and guards on it)
# but not ContextVar.get. The planner traces in the main thread, outside any compiled code.
_chosen_as_on: str | None = None


@contextlib.contextmanager
def as_on(device_type: str) -> Iterator[None]:
    """Within the block, every kernel here chooses as on `device_type`."""
    global _chosen_as_on
    previous, _chosen_as_on = _chosen_as_on, device_type
    try:
        yield
    finally:
        _chosen_as_on = previous


def _cpu_autocast(x: torch.Tensor) -> bool:
    """Whether `x` is computed as on a CPU under autocast (the CPU policies below)."""
    device_type = _chosen_as_on or x.device.type
    return device_type == "cpu" and torch.is_autocast_enabled("cpu")

# CPU autocast, sequences up to this many (query x key) tokens per head: the math path.
MATH_PATH_MAX_SCORES = 256 * 256


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              dropout_p: float = 0.0) -> torch.Tensor:
    """Scaled dot-product attention with the tutorial's device-dependent precision policy.

    On CPU under autocast (bf16 on a CPU with native bf16):
      * short sequences (<= MATH_PATH_MAX_SCORES query x key pairs per head): the math
        path in the autocast precision: softmax(q k^T / sqrt(d)) v as two reduced-precision
        matmuls (the PyTorch CPU softmax accumulates in fp32). It is faster than the fp32
        flash kernel (and its casts to fp32 and back) and than the bf16 flash kernel, which
        is slow at these small head sizes (docs/benchmarks.md). The scores
        (B x heads x N^2) are stored for the backward, hence the length limit;
      * longer sequences: the flash kernel in fp32 (no N^2 memory), the linear layers
        around it staying in reduced precision.
    On CUDA, reduced-precision SDPA is kept (flash attention is fast there).
    """
    if _cpu_autocast(q):
        # Decided by the key length, the whole sequence in every layout: context-parallel
        # ranks (fewer queries each) take the path the serial model takes.
        if k.shape[-2] ** 2 <= MATH_PATH_MAX_SCORES:
            return math_attention(q, k, v, dropout_p, torch.get_autocast_dtype("cpu"))
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                  dropout_p=dropout_p)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)


def patch_conv(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """A patch embedding's strided convolution; under CPU autocast computed as the GEMM it
    is, (B * tokens, C * p * p) @ (C * p * p, D), in the autocast precision.

    torch 2.13's oneDNN AMX kernel for this bf16 convolution (kernel = stride = 8, >= 16
    input channels: the ViT's and the AFNO's patch embedding at the CPU and full sizes)
    returns wrong outputs on CPUs with AMX, while every bf16 matmul is right. The same
    weights as a matmul give the convolution's result at bf16 rounding, faster than the
    convolution in fp32 (docs/benchmarks.md). GPUs keep the convolution.
    """
    k, s = conv.kernel_size, conv.stride
    if not _cpu_autocast(x):
        return conv(x)
    if k != s or conv.padding != (0, 0) or conv.dilation != (1, 1) or conv.groups != 1:
        with torch.autocast("cpu", enabled=False):  # not a patch embedding: fp32, safe
            return conv(x.float())
    B, C, H, W = x.shape
    h, w = H // k[0], W // k[1]
    x = x.to(torch.get_autocast_dtype("cpu"))  # cast before the copy: half the bytes
    patches = x.reshape(B, C, h, k[0], w, k[1]).permute(0, 2, 4, 1, 3, 5).reshape(B, h * w, -1)
    tokens = F.linear(patches, conv.weight.reshape(conv.out_channels, -1), conv.bias)
    return tokens.transpose(1, 2).reshape(B, conv.out_channels, h, w)  # the conv's layout


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v with both matmuls in `dtype`; the scale goes on q (N x d
    values) rather than on the N x N scores."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    weights = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-2, -1)).softmax(-1)
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p)
    return torch.matmul(weights, v)
