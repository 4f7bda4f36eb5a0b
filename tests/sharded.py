"""A model-parallel model's weights, gradients and fields in the serial layout and back: what
the tests compare against the serial model (the product maps checkpoints through
`distributed.layout.Layout.full_tensor` / `local_tensor` instead).

    load_serial_state_dict(model, serial.state_dict())   # the serial weights, sharded
    gather_full_state_dict(model), gather_full_grads(model)   # collective: every rank
                                                               # (also under FSDP)
    scatter_image(x, grid, patch), gather_image(tile, grid, patch)   # a spatial tile
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from distributed import comm, fsdp
from distributed.helpers import (
    all_gather_along_dim,
    compute_split_shapes,
    gather_tensor,
    shard_tensor,
)
from distributed.spatial import tile_bounds
from utils.model_wrappers import unwrap


def shard_state_dict(model: nn.Module, serial_sd: Mapping[str, torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
    """This rank's state dict for `model`, cut from a serial (single-device) state dict."""
    model = unwrap(model)
    params = dict(model.named_parameters())
    out = {}
    for name, value in model.state_dict().items():
        full = serial_sd[name]
        out[name] = shard_tensor(full, params[name]) if name in params else full
        if out[name].shape != value.shape:
            raise ValueError(f"{name}: shard {tuple(out[name].shape)} != {tuple(value.shape)}")
    return out


def load_serial_state_dict(model: nn.Module, serial_sd: Mapping[str, torch.Tensor]) -> None:
    """Copy a serial model's weights into the (tensor/context/spatially parallel) `model`."""
    unwrap(model).load_state_dict(shard_state_dict(model, serial_sd))


@torch.no_grad()
def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The serial state dict of a model-parallel model, also one FSDP shards (collective:
    call on every rank)."""
    model = unwrap(model)
    params = dict(model.named_parameters())
    return {name: gather_tensor(fsdp.gather(value), params[name]) if name in params else value
            for name, value in model.state_dict().items()}


@torch.no_grad()
def gather_full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Serial-layout gradients of a model-parallel model, also one FSDP shards (collective:
    every rank)."""
    return {name: gather_tensor(fsdp.gather(p.grad), p)
            for name, p in unwrap(model).named_parameters() if p.grad is not None}


def scatter_image(x: torch.Tensor, grid: tuple[int, int], patch_size: int) -> torch.Tensor:
    """This rank's tile of a full field (..., H, W); rows and columns past grid * patch_size
    are cropped, as the serial model does."""
    rows, cols = tile_bounds(grid, patch_size)
    return x[..., rows, cols].contiguous()


@torch.no_grad()
def gather_image(tile: torch.Tensor, grid: tuple[int, int], patch_size: int) -> torch.Tensor:
    """The full field (..., H, W) from every rank's tile (collective over h and w)."""
    rows = [n * patch_size for n in compute_split_shapes(grid[0], comm.get_size("h"))]
    cols = [n * patch_size for n in compute_split_shapes(grid[1], comm.get_size("w"))]
    out = all_gather_along_dim(tile, -2, "h", rows)
    return all_gather_along_dim(out, -1, "w", cols)
