"""Mixed precision: which dtype autocast uses, loss scaling, and attention's precision.

One policy for every model and layout: the serial ViT and the tensor/context-parallel
attention call the same `attention` here, so `train.py` and `train_mp.py` compute alike.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F


def autocast_dtype(amp_mode: str) -> torch.dtype | None:
    return {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[amp_mode]


def autocast(params: Any, device: torch.device):
    """The forward pass's autocast context for `params.amp_mode` (none: a null context)."""
    dtype = autocast_dtype(params.amp_mode)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(params: Any, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling keeps fp16 gradients from underflowing; bf16 and fp32 don't need it."""
    return torch.amp.GradScaler(device.type, enabled=params.amp_mode == "fp16")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              dropout_p: float = 0.0) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with the tutorial's device-dependent precision policy.

    On CPU under autocast, attention runs in fp32 while the linear layers around it stay
    bf16: the CPU flash-attention kernel (forward + backward) is ~3x slower in bf16 than in
    fp32 at this model's head size, whereas bf16 matmuls are 2-4x faster. With this mix a
    bf16 step of the cpu_short model ran 1.5x faster than with bf16 attention. On CUDA,
    reduced-precision SDPA is kept (flash attention is fast there).
    """
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                  dropout_p=dropout_p)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)


def patch_conv(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """A patch embedding's strided convolution, in fp32 under CPU autocast.

    torch 2.13's oneDNN AMX kernel for this bf16 convolution (kernel = stride = 8, >= 16
    input channels: the ViT's and the AFNO's patch embedding at the CPU and full sizes)
    returns wrong outputs on CPUs with AMX (relative error ~1.3 measured on a Sapphire
    Rapids-class Xeon; its backward and every bf16 matmul are right). The patch embedding is
    a few percent of a step, so it runs in fp32 on every CPU; GPUs keep autocast.
    """
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return conv(x.float())
    return conv(x)
