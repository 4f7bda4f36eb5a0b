"""Mixed precision: which dtype autocast uses (and what `amp_mode: auto` picks on this
hardware), loss scaling, and attention's precision.

One policy for every model and layout: the serial ViT and the tensor/context-parallel
attention call the same `attention` here, so `train.py` and `train_mp.py` compute alike.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F

from utils.hardware import CpuPrecision, cpu_name, cpu_precision, measure_slowdown

log = logging.getLogger("train")


def auto_amp_mode(device: torch.device, cpu: CpuPrecision | None = None) -> str:
    """What `amp_mode: auto` means on `device`: bf16 on GPUs that have it (Ampere and
    newer), fp16 on older GPUs, bf16 on CPUs that run it natively, otherwise none (an
    emulated bf16 GEMM can be 100x slower than fp32)."""
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    cpu = cpu or cpu_precision()
    return "bf16" if cpu.is_native("bf16") else "none"


def resolved(amp_mode: str, device: torch.device) -> str:
    return auto_amp_mode(device) if amp_mode == "auto" else amp_mode


def autocast_dtype(amp_mode: str) -> torch.dtype | None:
    return {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[amp_mode]


def autocast(params: Any, device: torch.device):
    """The forward pass's autocast context for `params.amp_mode` (none: a null context)."""
    dtype = autocast_dtype(resolved(params.amp_mode, device))
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(params: Any, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling keeps fp16 gradients from underflowing; bf16 and fp32 don't need it."""
    return torch.amp.GradScaler(device.type,
                                enabled=resolved(params.amp_mode, device) == "fp16")


def settle_amp_mode(params: Any, device: torch.device, cpu: CpuPrecision | None = None) -> str:
    """Replace `auto` in `params.amp_mode` by its choice for `device` and say which; warn
    (one line, once per process and mode) when a CPU only emulates the chosen precision,
    with the slowdown a 1-second matmul probe measured. Returns the mode."""
    mode = params.amp_mode
    if device.type != "cpu":
        params.amp_mode = resolved(mode, device)
        return params.amp_mode
    cpu = cpu or cpu_precision()
    if mode == "auto":
        params.amp_mode = auto_amp_mode(device, cpu)
        why = (f"native on this CPU ({cpu.evidence})" if params.amp_mode != "none" else
               f"no native bf16 on this CPU ({cpu.evidence})")
        log.info(f"amp_mode auto -> {params.amp_mode}: {why}")
    elif mode != "none" and not cpu.is_native(mode):
        warn_emulated(mode, cpu)
    return params.amp_mode


@functools.cache
def warn_emulated(mode: str, cpu: CpuPrecision) -> None:
    rates = measure_slowdown(mode)
    log.warning(f"amp_mode {mode} is emulated on this CPU ({cpu_name()}; {cpu.evidence}): "
                f"a {rates.n}^3 matmul measured {rates.slowdown:.1f}x the time of fp32 "
                f"({rates.reduced:.1f} vs {rates.fp32:.1f} GFLOP/s); amp_mode auto "
                f"picks {auto_amp_mode(torch.device('cpu'), cpu)} here")


# CPU autocast, sequences up to this many (query x key) tokens per head: the math path.
MATH_PATH_MAX_SCORES = 256 * 256


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              dropout_p: float = 0.0) -> torch.Tensor:
    """Scaled dot-product attention with the tutorial's device-dependent precision policy.

    On CPU under autocast (bf16 on a CPU with native bf16; one 2-core AVX-512-BF16/AMX
    Xeon measured here, single-thread CPU time per block, forward + backward, cpu_short
    shapes: 16 x 8 heads x 128 tokens x 24):
      * short sequences (<= MATH_PATH_MAX_SCORES query x key pairs per head): the math
        path in the autocast precision: softmax(q k^T / sqrt(d)) v as two reduced-precision
        matmuls (the PyTorch CPU softmax accumulates in fp32) — 8.7 ms, against 14.1 ms for
        the fp32 flash kernel (plus the casts to fp32 and back) and 52.6 ms for the bf16
        flash kernel, which is slow at this small head size. The scores (B x heads x N^2)
        are stored for the backward, hence the length limit;
      * longer sequences: the flash kernel in fp32 (no N^2 memory), the linear layers
        around it staying in reduced precision.
    On CUDA, reduced-precision SDPA is kept (flash attention is fast there).
    """
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
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
    returns wrong outputs on CPUs with AMX (relative error ~1.3 measured on a Sapphire
    Rapids-class Xeon), while every bf16 matmul is right. The same weights as a matmul give
    the convolution's result at bf16 rounding, and a bf16 cpu_short step ran 8 % faster
    than with the convolution in fp32 (CPU time, 2 threads). GPUs keep the convolution.
    """
    k, s = conv.kernel_size, conv.stride
    if not (x.device.type == "cpu" and torch.is_autocast_enabled("cpu")):
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
