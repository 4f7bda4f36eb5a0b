"""FourCastNet: the Adaptive Fourier Neural Operator forecaster (AFNO, Guibas et al. 2021;
FourCastNet, Pathak et al. 2022), written from the papers.

(B, C, H, W) fields -> non-overlapping patches -> (B, h, w, D) token grid, channels last,
plus a learned position embedding -> `depth` AFNO blocks -> LayerNorm -> linear head ->
unpatchify to (B, C_out, H, W). An AFNO block mixes tokens in Fourier space instead of
with attention:

    u = LayerNorm(x)
    x = x + u + irfft2(shrink(MLP_k(rfft2(u))))   the spectral filter and its two skips
    x = x + MLP(LayerNorm(x))                     the channel MLP, as in a transformer

MLP_k is a 2-layer complex MLP (ReLU) applied to every kept frequency k with the same
weights, block-diagonal over channels (`num_blocks` independent blocks); shrink is a soft
threshold (`sparsity_threshold`) on the real and imaginary parts, which sparsifies the
spectrum; modes above `hard_thresholding_fraction` of each axis are dropped (zero).

FourCastNet as NVIDIA publishes it (`afno_variant: fourcastnet`: the original code, PhysicsNeMo's
`AFNO`, Earth2Studio's FCN, whose weights tools/fourcastnet_weights.py loads) differs in four
details, each reproduced by the variant: no LayerNorm before the head (the original defines
one and never applies it), a head without bias, LayerNorm eps 1e-6 (PyTorch's default is
1e-5), and the Fourier modes its code keeps (networks/spectral.py, `kept_modes`: of the
longitudes only those below the rows' count, H // 2 + 1).

An ensemble member (`noise_channels` > 0) also takes its noise, (B, noise_channels, h, w) on
this rank's token tile, which scales and shifts both norms of every block as in the ViT
(networks/noise.py): pointwise per token, so a tile's tokens need only their own noise.

The layers that depend on the layout come from `layers`: `SerialGrid` here (one device),
`distributed.spatial.SpatialLayers` for a token grid split over the h x w mesh. The model
then works on this rank's tile: its input is the tile's pixels, its output the tile's
forecast.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from networks.blocks import (
    MLP,
    PreNormBlock,
    WholeParameters,
    config_keys,
    init_weights,
    run_blocks,
    unpatchify,
)
from networks.kernels import patch_conv
from networks.noise import NoiseEmbed, NoiseModulation, check_noise
from networks.spectral import Modes, RealFFT2, kept_modes
from utils.config_schema import Config

# `afno_variant`: this repository's AFNO, or FourCastNet's as published (module docstring).
VARIANTS = ("default", "fourcastnet")


class SerialGrid(WholeParameters):
    """Layer factory for one device: the tile is the whole grid, the FFT is torch's."""

    def tile(self, grid: tuple[int, int]) -> tuple[int, int]:
        return grid

    def spectral_transform(self, modes: Modes, num_blocks: int, block_size: int) -> RealFFT2:
        return RealFFT2(modes, num_blocks * block_size)

    def annotate(self, model: nn.Module) -> None:
        """Parallel layouts record how each parameter is laid out; nothing to do here."""


class SpectralFilter(nn.Module):
    """AFNO token mixing: rfft2 -> block-diagonal complex MLP per mode -> soft shrinkage ->
    irfft2, plus the filter's input (the inner skip). Runs in fp32 (no complex bf16)."""

    def __init__(self, dim: int, num_blocks: int, transform: RealFFT2,
                 sparsity_threshold: float = 0.01, hidden_size_factor: int = 1):
        super().__init__()
        if dim % num_blocks:
            raise ValueError(f"embed_dim {dim} is not divisible by num_blocks {num_blocks}")
        bs = dim // num_blocks
        hidden = bs * hidden_size_factor
        # index 0: real part, 1: imaginary part of complex weights
        self.w1 = nn.Parameter(torch.empty(2, num_blocks, bs, hidden))
        self.b1 = nn.Parameter(torch.empty(2, num_blocks, hidden))
        self.w2 = nn.Parameter(torch.empty(2, num_blocks, hidden, bs))
        self.b2 = nn.Parameter(torch.empty(2, num_blocks, bs))
        self.block_size, self.lambd, self.transform = bs, sparsity_threshold, transform
        ch = transform.channels  # the channel blocks whose spectrum this rank holds
        self.blocks = slice(ch.start // bs, ch.stop // bs)

    def _complex_linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """[re | im] (..., blocks, 2n) times complex (w_re + i w_im), plus b, as one real
        block matmul: [re | im] @ [[w_re, w_im], [-w_im, w_re]] = [re' | im']."""
        w, b = w[:, self.blocks], b[:, self.blocks]
        real_form = torch.cat([torch.cat([w[0], w[1]], -1), torch.cat([-w[1], w[0]], -1)], -2)
        return torch.einsum("...ni,nio->...no", x, real_form) + torch.cat([b[0], b[1]], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            u = x.float()
            spec = self.transform.forward(u)  # (B, KH, KW_i, C_j) complex
            z = torch.cat([spec.real, spec.imag], -1)  # [re | im] -> per block [re | im]:
            z = z.unflatten(-1, (2, -1, self.block_size)).transpose(-3, -2).flatten(-2)
            z = F.relu(self._complex_linear(z, self.w1, self.b1))
            z = F.softshrink(self._complex_linear(z, self.w2, self.b2), self.lambd)
            re, im = z.unflatten(-1, (2, -1)).unbind(-2)  # each (..., blocks, bs)
            spec = torch.complex(re.flatten(-2), im.flatten(-2))
            return (self.transform.inverse(spec) + u).to(x.dtype)


class AFNOBlock(PreNormBlock):
    """x + filter(norm1(x)) (the filter adds its own input: the double skip), then a
    pre-norm channel MLP with its residual; with `cond_dim` (an ensemble member) the norms
    are modulated by the noise (networks/blocks.py)."""

    def __init__(self, dim: int, mlp_ratio: float, filter_: SpectralFilter, cond_dim: int = 0,
                 eps: float = 1e-5):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.filter = filter_
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim, int(dim * mlp_ratio))
        self.noise_mod = NoiseModulation(cond_dim, dim) if cond_dim else None

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        return self.filter(x)


class AFNONet(nn.Module):
    def __init__(
        self,
        img_size: tuple[int, int] = (360, 720),
        patch_size: int = 8,
        in_chans: int = 20,
        out_chans: int = 20,
        embed_dim: int = 768,
        depth: int = 12,
        num_blocks: int = 8,
        mlp_ratio: float = 4.0,
        sparsity_threshold: float = 0.01,
        hard_thresholding_fraction: float = 1.0,
        hidden_size_factor: int = 1,
        layers: Any = None,
        seed: int = 0,
        activation_checkpointing: str = "none",
        noise_channels: int = 0,
        noise_embed_dim: int = 32,
        variant: str = "default",
    ):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"afno_variant {variant!r}: expected one of {', '.join(VARIANTS)}")
        fourcastnet = variant == "fourcastnet"
        eps = 1e-6 if fourcastnet else 1e-5
        self.patch_size, self.out_chans = patch_size, out_chans
        self.recompute_blocks = activation_checkpointing == "blocks"  # networks/blocks.py
        self.grid = (img_size[0] // patch_size, img_size[1] // patch_size)
        self.layer_factory = layers = layers or SerialGrid()
        self.tile = layers.tile(self.grid)  # (rows, columns) of tokens on this rank
        self.patch_embed = nn.Conv2d(in_chans, embed_dim, patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, *self.tile, embed_dim))
        self.noise_channels = noise_channels  # 0: deterministic, no noise taken
        cond_dim = noise_embed_dim if noise_channels else 0
        self.noise_embed = NoiseEmbed(noise_channels, cond_dim) if cond_dim else None
        modes = kept_modes(self.grid, hard_thresholding_fraction, fourcastnet)
        self.blocks = nn.ModuleList(
            AFNOBlock(embed_dim, mlp_ratio, SpectralFilter(
                embed_dim, num_blocks,
                layers.spectral_transform(modes, num_blocks, embed_dim // num_blocks),
                sparsity_threshold, hidden_size_factor), cond_dim, eps)
            for _ in range(depth))
        self.norm = None if fourcastnet else nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, out_chans * patch_size * patch_size,
                              bias=not fourcastnet)
        layers.annotate(self)  # before init: a sharded parameter draws its full tensor
        init_weights(self, seed, layers)

    def forward(self, x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's pixel tile (B, C_in, h p, w p) -> its forecast (B, C_out, h p, w p);
        an ensemble member's `noise`: (B, noise_channels, h, w), this tile's tokens."""
        p, (h, w) = self.patch_size, self.tile
        if tuple(x.shape[-2:]) != (h * p, w * p):
            raise ValueError(f"input tile {tuple(x.shape[-2:])} != {(h * p, w * p)}: "
                             f"{h} x {w} tokens of patch {p} on this rank")
        check_noise(noise, self.noise_channels, self.tile)
        # channels last, contiguous once: every later layer acts on the last dim
        x = patch_conv(self.patch_embed, x)  # a bf16 GEMM under CPU autocast: networks.kernels
        x = x.permute(0, 2, 3, 1).contiguous() + self.pos_embed
        cond = None if noise is None else self.noise_embed(noise.permute(0, 2, 3, 1))
        x = run_blocks(self.blocks, x, self.recompute_blocks, cond)
        x = self.head(x if self.norm is None else self.norm(x))  # (B, h, w, p*p*C_out)
        return unpatchify(x, self.tile, p, self.out_chans)


# ------------------------------------------------------------------ closed-form counts

def count_parameters(embed_dim: int, depth: int, patch_size: int, in_chans: int,
                     out_chans: int, grid: tuple[int, int], num_blocks: int,
                     mlp_ratio: float = 4.0, hidden_size_factor: int = 1,
                     variant: str = "default") -> int:
    """Closed-form parameter count of `AFNONet` (checked against the module in tests)."""
    D, p = embed_dim, patch_size
    hidden = int(D * mlp_ratio)
    bs, f = D // num_blocks, hidden_size_factor
    spectral = 2 * num_blocks * (2 * bs * bs * f + bs * f + bs)  # w1, w2, b1, b2
    block = 2 * 2 * D + spectral + (D * hidden + hidden) + (hidden * D + D)
    head = D * out_chans * p * p
    if variant != "fourcastnet":  # the final norm and the head's bias
        head += 2 * D + out_chans * p * p
    return in_chans * p * p * D + D + grid[0] * grid[1] * D + depth * block + head


def flops_per_sample(img_size: tuple[int, int], patch_size: int, in_chans: int,
                     out_chans: int, embed_dim: int, depth: int, num_blocks: int,
                     mlp_ratio: float = 4.0, hard_thresholding_fraction: float = 1.0,
                     hidden_size_factor: int = 1, variant: str = "default") -> dict[str, int]:
    """Forward FLOPs of one sample, by part (see `training_flops_per_sample`)."""
    h, w = img_size[0] // patch_size, img_size[1] // patch_size
    N, D, p = h * w, embed_dim, patch_size
    modes = kept_modes((h, w), hard_thresholding_fraction, variant == "fourcastnet")
    M = modes.rows * modes.kw  # kept complex modes
    bs = D // num_blocks
    return {
        "patch_embed": 2 * N * in_chans * p * p * D,
        "fft": depth * 2 * round(5 * N * math.log2(N)) * D,
        "spectral_mlp": depth * 16 * M * D * bs * hidden_size_factor,
        "channel_mlp": depth * 2 * 2 * N * D * int(D * mlp_ratio),
        "head": 2 * N * D * out_chans * p * p,
    }


def training_flops_per_sample(img_size: tuple[int, int], patch_size: int, in_chans: int,
                              out_chans: int, embed_dim: int, depth: int, num_blocks: int,
                              mlp_ratio: float = 4.0, hard_thresholding_fraction: float = 1.0,
                              hidden_size_factor: int = 1, variant: str = "default") -> int:
    """Analytic FLOPs of one training sample (forward + backward = 3 x forward).

    A (m x k) @ (k x n) matmul is 2 m k n FLOPs. Per sample, N = h w tokens of width D:
      patch embed    2 N (C_in p^2) D
      FFTs           2 per block (forward and inverse), each 5 N log2 N per channel: the
                     textbook count of a complex FFT. A real FFT of real data needs about
                     half, and truncation skips part of the second axis, so this is an
                     upper estimate; FFTs are a few % of the total at the configs' sizes.
      spectral MLP   M = KH x KW kept modes; per mode, 2 complex layers, each block-diagonal
                     (num_blocks blocks of bs x bs f). A complex matmul is 4 real ones:
                     4 x 2 (bs)(bs f) per block and layer -> 16 M D bs f for both layers
      channel MLP    2 x 2 N D (r D)
      head           2 N D (C_out p^2)
    Norms, activations, shrinkage, biases and adds are ignored (memory bound, small).
    """
    parts = flops_per_sample(img_size, patch_size, in_chans, out_chans, embed_dim, depth,
                             num_blocks, mlp_ratio, hard_thresholding_fraction,
                             hidden_size_factor, variant)
    return 3 * sum(parts.values())


def afno_from_params(cfg: Config, layers: Any = None) -> AFNONet:
    """Build the model from a config. `layers`: the layer factory, serial by default; a
    spatial layout passes `distributed.spatial.SpatialLayers()` when the grid is split
    over h x w ranks."""
    return AFNONet(
        num_blocks=cfg.num_blocks,
        sparsity_threshold=cfg.sparsity_threshold,
        hard_thresholding_fraction=cfg.hard_thresholding_fraction,
        variant=cfg.afno_variant,
        layers=layers,
        **config_keys(cfg),
    )
