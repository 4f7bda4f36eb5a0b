"""Autoregressive rollout: a 6-hour model applied to its own output to forecast further.

Used by inference.py for forecast skill; a multi-step training loss can call it inside the
training step's autocast (gradients flow through every step).
"""

from __future__ import annotations

import torch


def rollout(model: torch.nn.Module, x0: torch.Tensor, steps: int) -> torch.Tensor:
    """x_k = model(x_{k-1}) for k = 1..steps, from x0 (B, C, H, W).

    Returns the predictions stacked as (B, steps, C, H, W), in fp32: each step's output is
    cast back to fp32 before it becomes the next input, so under bf16/fp16 autocast the
    state carried from step to step is not rounded to 8 or 11 bits of mantissa every 6 hours
    (the matmuls inside the model still run in reduced precision).
    """
    if steps < 1:
        raise ValueError(f"a rollout needs at least one step, got {steps}")
    x, preds = x0, []
    for _ in range(steps):
        x = model(x).float()
        preds.append(x)
    return torch.stack(preds, dim=1)
