"""What an ensemble member is conditioned on: noise, through every block's norms.

An ensemble forecaster (`ensemble_size` E > 1) is one network run E times per initial
condition, each time with other noise: N(0, 1) numbers, `noise_channels` of them at every
token of the grid (networks/ensemble.py draws them). The network turns them into a small
embedding per token (`NoiseEmbed`: a two-layer MLP, `noise_embed_dim` wide) and every
block turns that into a scale and a shift of its two norms' outputs (`NoiseModulation`):

    u = LayerNorm(x) * (1 + scale(z)) + shift(z)      z = NoiseEmbed(noise), per token

Why this form (the conditional LayerNorm of AIFS-CRPS and of diffusion transformers):
  - noise in every block, not only at the input: a member can differ from its peers in
    what each block does, not only in a perturbed start that the first blocks may learn to
    smooth away;
  - the modulation is zero-initialised: scale = shift = 0, so an untrained ensemble (or a
    deterministic model fine-tuned into one, `init_from`) computes exactly the
    deterministic model, member for member, and training grows the spread the CRPS asks for
    (its first gradient is not zero: the modulation's weight gradient is the noise embedding
    times the gradient of the norm's output);
  - pointwise per token, like the norms it modulates: nothing new to split over the
    tensor, context or spatial ranks (each rank conditions its own tokens on their noise);
  - small: the embedding is `noise_embed_dim` wide (32), so each block's modulation adds
    4 x embed_dim x 32 weights, a few per cent of the block.
The noise is white from token to token; the blocks' attention (or the AFNO's Fourier
filter) gives it spatial structure where the loss rewards it.

The embedding's first layers are initialised for unit-variance activations (1 / sqrt(fan in),
`init_std`), not the 0.02 of the network's other weights: at 0.02 the embedding of N(0, 1)
noise would be ~1e-3, and the modulation would start deaf to it.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from utils.config_schema import Config


class NoiseEmbed(nn.Module):
    """(..., noise_channels) N(0, 1) noise per token -> (..., embed_dim) embedding."""

    def __init__(self, noise_channels: int, embed_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(noise_channels, embed_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(embed_dim, embed_dim)
        self.fc1.init_std = 1.0 / math.sqrt(noise_channels)  # read by networks.blocks.init_weights
        self.fc2.init_std = 1.0 / math.sqrt(embed_dim)

    def forward(self, noise: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(noise)))


class NoiseModulation(nn.Module):
    """A block's scales and shifts of its two norms from the noise embedding: one linear
    layer (zero-initialised: the identity modulation) -> (scale1, shift1, scale2, shift2)."""

    def __init__(self, cond_dim: int, dim: int):
        super().__init__()
        self.linear = nn.Linear(cond_dim, 4 * dim)
        self.linear.zero_init = True  # read by networks.blocks.init_weights

    def forward(self, cond: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(cond).chunk(4, dim=-1)


def modulate(x: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None
             ) -> torch.Tensor:
    """A norm's output x scaled by (1 + scale) and shifted: the identity at scale = shift = 0,
    and x itself, untouched, without noise (None)."""
    return x if scale is None else x * (1.0 + scale) + shift


def noise_keys(cfg: Config) -> dict[str, int]:
    """The noise conditioning of the config's model: none for a deterministic forecast
    (ensemble_size 1), else `noise_channels` channels embedded `noise_embed_dim` wide."""
    if cfg.ensemble_size == 1:
        return {"noise_channels": 0}
    return {"noise_channels": cfg.noise_channels, "noise_embed_dim": cfg.noise_embed_dim}


def check_noise(noise: torch.Tensor | None, channels: int, tiles: tuple[int, int]) -> None:
    """A model conditioned on `channels` noise channels (0: none) takes noise of
    (B, channels, *tiles), tokens on its grid or tile; a deterministic model takes none."""
    if channels == 0 and noise is not None:
        raise ValueError("a deterministic model (noise_channels 0) takes no noise")
    if channels and noise is None:
        raise ValueError("an ensemble member needs its noise (networks/ensemble.py draws it)")
    if noise is not None and (noise.dim() != 4 or tuple(noise.shape[1:]) != (channels, *tiles)):
        raise ValueError(f"noise of shape {tuple(noise.shape)}, expected (B, {channels}, "
                         f"{tiles[0]}, {tiles[1]}): noise channels on the token grid")


def is_noise_parameter(name: str) -> bool:
    """Whether the parameter `name` (as named_parameters gives it) belongs to the noise
    conditioning: what a deterministic checkpoint lacks (training/checkpoint.py)."""
    return name.startswith("noise_embed.") or ".noise_mod." in name
