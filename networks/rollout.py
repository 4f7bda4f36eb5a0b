"""Autoregressive rollout: a 6-hour model applied to its own output to forecast further.

Used by inference.py for forecast skill; a multi-step training loss can call it inside the
training step's autocast (gradients flow through every step).
"""

from __future__ import annotations

import torch

from networks.ensemble import member_inputs


def rollout(model: torch.nn.Module, x0: torch.Tensor, steps: int,
            noise: torch.Tensor | None = None) -> torch.Tensor:
    """x_k = model(x_{k-1}) for k = 1..steps, from x0 (B, C, H, W).

    Returns the predictions stacked as (B, steps, C, H, W), in fp32: each step's output is
    cast back to fp32 before it becomes the next input, so under bf16/fp16 autocast the
    state carried from step to step is not rounded to 8 or 11 bits of mantissa every 6 hours
    (the matmuls inside the model still run in reduced precision).

    An ensemble's members (`noise`: (steps, B, M, noise_channels, h, w), this rank's M
    members' noise, networks/ensemble.py): every member starts from its sample's x0 and
    rolls out with its own noise, fresh at every step; returns (B, steps, M, C, H, W).
    """
    if steps < 1:
        raise ValueError(f"a rollout needs at least one step, got {steps}")
    if noise is not None and (noise.shape[0] != steps or noise.shape[1] != x0.shape[0]):
        raise ValueError(f"noise for {noise.shape[0]} steps of {noise.shape[1]} samples, "
                         f"the rollout has {steps} steps of {x0.shape[0]}")
    members = 1 if noise is None else noise.shape[2]
    x = x0 if noise is None else member_inputs(x0, members)
    preds = []
    for k in range(steps):
        x = (model(x) if noise is None else model(x, noise[k].flatten(0, 1))).float()
        preds.append(x)
    out = torch.stack(preds, dim=1)  # (B M, steps, C, H, W)
    if noise is None:
        return out
    return out.unflatten(0, (x0.shape[0], members)).transpose(1, 2)
