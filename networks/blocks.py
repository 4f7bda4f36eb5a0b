"""What both networks (networks/vit.py, networks/afno.py) are built of: the channel MLP,
the pre-norm residual block around a token mixer, the stack of blocks run with or without
activation checkpointing, and the initialisation that does not depend on the layout.

Activation checkpointing: backward needs what each block computed in the forward pass (the
inputs of its matmuls, norms and activations). Kept, these are most of a rank's memory at
the tutorial's sizes (docs/memory.md). With `recompute`, a block keeps only its input; its
backward first runs the block's forward again (`torch.utils.checkpoint`, non-reentrant),
then differentiates it: one more forward pass of compute for the activations of one block
instead of all of them.

The recomputed forward is the same computation on the same input, so it gives the same
numbers bit for bit: the collectives inside a tensor-, context- or spatially-parallel block
(all-reduce, all-gather, all-to-all) run again, in the same order on every rank of their
group, and sum the same values in the same order (tests/test_activation_checkpointing.py).
Dropout draws the same mask again: checkpoint restores the RNG state it saw in the forward.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from networks.noise import modulate, noise_keys
from utils.config_schema import Config


def config_keys(cfg: Config) -> dict[str, Any]:
    """What both networks take from a config, under their constructors' names; each
    network's `*_from_params` adds its own keys."""
    return {
        "img_size": tuple(cfg.img_size),
        "patch_size": cfg.patch_size,
        "in_chans": cfg.n_in_channels,
        "out_chans": cfg.n_out_channels,
        "embed_dim": cfg.embed_dim,
        "depth": cfg.depth,
        "mlp_ratio": cfg.mlp_ratio,
        "seed": cfg.seed,
        "activation_checkpointing": cfg.activation_checkpointing,
        **noise_keys(cfg),
    }


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class PreNormBlock(nn.Module):
    """x + mix(norm1(x)), then x + mlp(norm2(x)). The subclass builds `norm1`, `norm2`,
    `mlp`, its token mixer (attention, the Fourier filter) under its own name, and, for an
    ensemble member, `noise_mod`; `mix` runs the mixer. With the noise embedding `cond`, each
    norm's output is scaled and shifted by it (networks/noise.py); without, it is left as is."""

    norm1: nn.Module
    norm2: nn.Module
    mlp: nn.Module
    noise_mod: nn.Module | None

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        scale1, shift1, scale2, shift2 = (None,) * 4 if cond is None else self.noise_mod(cond)
        x = x + self.mix(modulate(self.norm1(x), scale1, shift1))
        return x + self.mlp(modulate(self.norm2(x), scale2, shift2))


def unpatchify(x: torch.Tensor, grid: tuple[int, int], patch_size: int, out_chans: int
               ) -> torch.Tensor:
    """The head's output on an (h, w) token grid, (B, h w, p p C) or (B, h, w, p p C), back to
    pixels (B, C, h p, w p): each token becomes its p x p patch of every channel."""
    (h, w), p, C = grid, patch_size, out_chans
    x = x.reshape(x.shape[0], h, w, p, p, C)
    return x.permute(0, 5, 1, 3, 2, 4).reshape(x.shape[0], C, h * p, w * p)


def run_blocks(blocks: Iterable[nn.Module], x: torch.Tensor, recompute: bool,
               cond: torch.Tensor | None = None) -> torch.Tensor:
    """x through every block in turn; `recompute`: each block's activations are recomputed
    in backward instead of kept (only when a backward can follow: under no_grad there is
    nothing to keep). `cond`: an ensemble member's noise embedding, given to every block
    (networks/noise.py); a recompute gets the same tensor, as the noise was drawn before."""
    recompute = recompute and torch.is_grad_enabled()
    for block in blocks:
        args = (x,) if cond is None else (x, cond)
        x = checkpoint(block, *args, use_reentrant=False) if recompute else block(*args)
    return x


class WholeParameters:
    """How one device holds every parameter: whole. A parallel layer factory shards some
    and says how (`full_shape`, `local_part`); the serial factories inherit this."""

    def full_shape(self, param: torch.Tensor) -> list[int]:
        return list(param.shape)

    def local_part(self, full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        return full


def init_weights(model: nn.Module, seed: int = 0, layers: Any = None) -> None:
    """Initialise every parameter from its own generator, seeded by (seed, name).

    The numbers then do not depend on the parallel layout: a sharded parameter draws its
    full serial tensor (one parameter at a time, so memory stays small) and keeps its
    part (`layers.full_shape` / `layers.local_part`), so train_mp.py with any tp/cp starts
    from exactly the weights train.py uses.
    Weights ~ N(0, 0.02) truncated at 2 std (a layer that sets `init_std`: that std), biases
    0, LayerNorm scales 1; a layer that sets `zero_init` is all zeros (networks/noise.py).
    """
    layers = layers or WholeParameters()
    for module_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            name = f"{module_name}.{pname}" if module_name else pname
            shape = layers.full_shape(p)
            if isinstance(module, nn.LayerNorm):
                full = torch.ones(shape) if pname == "weight" else torch.zeros(shape)
            elif pname == "bias" or getattr(module, "zero_init", False):
                full = torch.zeros(shape)
            else:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                full = _truncated_normal(shape, std=getattr(module, "init_std", 0.02),
                                         generator=gen)
            with torch.no_grad():
                p.copy_(layers.local_part(full, p))


def _truncated_normal(shape: list[int], std: float, generator: torch.Generator) -> torch.Tensor:
    """N(0, std) truncated at +-2 std by inverting the CDF of a uniform draw: one pass,
    no rejection loop, so initialising a large model takes well under a second."""
    lo = 0.5 * (1.0 + math.erf(-2.0 / math.sqrt(2.0)))
    u = torch.empty(shape).uniform_(lo, 1.0 - lo, generator=generator)
    return torch.erfinv(2.0 * u - 1.0).mul_(math.sqrt(2.0) * std)
