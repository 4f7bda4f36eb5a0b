"""The user's module inside the wrappers a run adds (DDP, torch.compile)."""

from __future__ import annotations

import torch


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module torch.compile wrapped (DDP stays), or `model` when it is not compiled."""
    return getattr(model, "_orig_mod", model)
