"""Vision Transformer for 6-hour weather forecasting (the tutorial's model).

(B, C, H, W) fields -> patch embedding -> pre-norm transformer blocks -> linear head ->
unpatchify back to (B, C, H, W). The block's layers come from `layer_factory` so that the
model-parallel code can swap in distributed versions without touching this file's logic.

An ensemble member (`noise_channels` > 0) also takes its noise, (B, noise_channels, h, w) on
the token grid, which scales and shifts the norms of every block (networks/noise.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from networks.blocks import (
    MLP,
    PreNormBlock,
    WholeParameters,
    config_keys,
    init_weights,
    run_blocks,
    unpatchify,
)
from networks.kernels import attention, patch_conv
from networks.noise import NoiseEmbed, NoiseModulation, check_noise
from utils.config_schema import Config


class PatchEmbed(nn.Module):
    """Non-overlapping patches -> tokens, via a strided convolution."""

    def __init__(self, img_size: tuple[int, int], patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        self.grid = (img_size[0] // patch_size, img_size[1] // patch_size)
        self.num_patches = self.grid[0] * self.grid[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = patch_conv(self.proj, x)  # a bf16 GEMM under CPU autocast: networks.kernels
        # (B, N, D). Made contiguous once here: a transposed token stream would stay
        # transposed through every residual add and make each LayerNorm (forward and
        # backward) copy its input.
        return x.flatten(2).transpose(1, 2).contiguous()


class Attention(nn.Module):
    """Multi-head self-attention; q, k and v come from one fused matmul."""

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        # Split along the "3" axis first: in backward the three gradients are then stacked
        # straight into qkv's (B, N, 3, heads, head_dim) layout, with no extra copy.
        qkv = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # each (B, heads, N, head_dim)
        x = attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(x.transpose(1, 2).reshape(B, N, -1))


class SerialLayers(WholeParameters):
    """Layer factory for one device. `distributed.layers.DistributedLayers` is the parallel
    one: train_mp.py passes it to the model, which is otherwise the same code."""

    def attention(self, dim: int, num_heads: int, dropout: float) -> nn.Module:
        return Attention(dim, num_heads, dropout)

    def mlp(self, dim: int, hidden_dim: int, dropout: float) -> nn.Module:
        return MLP(dim, hidden_dim, dropout)

    def norm(self, dim: int) -> nn.Module:
        return nn.LayerNorm(dim)

    # An ensemble member's noise conditioning (networks/noise.py): per token, like the norms.
    def noise_embed(self, noise_channels: int, cond_dim: int) -> nn.Module:
        return NoiseEmbed(noise_channels, cond_dim)

    def noise_modulation(self, cond_dim: int, dim: int) -> nn.Module:
        return NoiseModulation(cond_dim, dim)

    # Context parallelism splits the token sequence between these two calls; one device: no-op.
    def scatter_tokens(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def replicated(self, *parts: Any) -> None:
        """Marks parameters every rank holds whole and applies to all tokens (no-op here)."""


class Block(PreNormBlock):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x)); with
    `cond_dim` (an ensemble member) the norms are modulated by the noise (networks/blocks.py)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, dropout: float, layers: Any,
                 cond_dim: int = 0):
        super().__init__()
        self.norm1 = layers.norm(dim)
        self.attn = layers.attention(dim, num_heads, dropout)
        self.norm2 = layers.norm(dim)
        self.mlp = layers.mlp(dim, int(dim * mlp_ratio), dropout)
        self.noise_mod = layers.noise_modulation(cond_dim, dim) if cond_dim else None

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


class VisionTransformer(nn.Module):
    def __init__(
        self,
        img_size: tuple[int, int] = (360, 720),
        patch_size: int = 8,
        in_chans: int = 20,
        out_chans: int = 20,
        embed_dim: int = 384,
        depth: int = 12,
        num_heads: int = 8,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        layers: Any = None,
        seed: int = 0,
        activation_checkpointing: str = "none",
        noise_channels: int = 0,
        noise_embed_dim: int = 32,
    ):
        super().__init__()
        self.img_size = tuple(img_size)
        self.patch_size = patch_size
        self.out_chans = out_chans
        self.layer_factory = layers = layers or SerialLayers()
        self.recompute_blocks = activation_checkpointing == "blocks"  # networks/blocks.py
        self.patch_embed = PatchEmbed(self.img_size, patch_size, in_chans, embed_dim)
        self.h, self.w = self.patch_embed.grid
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches, embed_dim))
        self.pos_drop = nn.Dropout(dropout)
        self.noise_channels = noise_channels  # 0: deterministic, no noise taken
        cond_dim = noise_embed_dim if noise_channels else 0
        self.noise_embed = layers.noise_embed(noise_channels, cond_dim) if cond_dim else None
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, mlp_ratio, dropout, layers, cond_dim)
            for _ in range(depth)
        )
        self.norm = layers.norm(embed_dim)
        self.head = nn.Linear(embed_dim, out_chans * patch_size * patch_size)
        init_weights(self, seed, layers)
        layers.replicated(self.patch_embed, self.pos_embed, self.head)  # outside the token split

    def condition(self, noise: torch.Tensor | None) -> torch.Tensor | None:
        """A member's noise (B, noise_channels, h, w) on the whole token grid -> its
        embedding (B, N, noise_embed_dim) on this rank's tokens (split as the tokens are);
        None for a deterministic model."""
        check_noise(noise, self.noise_channels, (self.h, self.w))
        if noise is None:
            return None
        tokens = noise.flatten(2).transpose(1, 2)  # (B, N, noise_channels), the tokens' order
        return self.noise_embed(self.layer_factory.scatter_tokens(tokens))

    def forward_tokens(self, x: torch.Tensor, noise: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """(B, C, H, W) -> normalised tokens (B, N, D)."""
        x = self.pos_drop(self.patch_embed(x) + self.pos_embed)
        x = self.layer_factory.scatter_tokens(x)
        x = run_blocks(self.blocks, x, self.recompute_blocks, self.condition(noise))
        return self.layer_factory.gather_tokens(self.norm(x))

    def forward(self, x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """(B, C, H, W) -> the forecast (B, C, H, W); an ensemble member's `noise`:
        (B, noise_channels, h, w) on the token grid."""
        x = self.head(self.forward_tokens(x, noise))  # (B, N, p*p*C_out)
        return unpatchify(x, (self.h, self.w), self.patch_size, self.out_chans)


def count_parameters(embed_dim: int, depth: int, patch_size: int, in_chans: int,
                     out_chans: int, num_tokens: int, mlp_ratio: float = 4.0) -> int:
    """Closed-form parameter count of `VisionTransformer` (checked against the module in tests)."""
    D, p, hidden = embed_dim, patch_size, int(embed_dim * mlp_ratio)
    patch = in_chans * p * p * D + D
    block = 2 * 2 * D + (D * 3 * D + 3 * D) + (D * D + D) + (D * hidden + hidden) + (hidden * D + D)
    head = D * out_chans * p * p + out_chans * p * p
    return patch + num_tokens * D + depth * block + 2 * D + head


def training_flops_per_sample(img_size: tuple[int, int], patch_size: int, in_chans: int,
                              out_chans: int, embed_dim: int, depth: int,
                              mlp_ratio: float = 4.0) -> int:
    """Analytic matmul FLOPs of one training sample (forward + backward = 3 x forward).

    A (m x k) @ (k x n) matmul is 2*m*k*n FLOPs. Per sample with N tokens and width D:
      patch embed  2 N (C p^2) D        q,k,v   2 N D (3D)      proj  2 N D D
      scores QK^T  2 N N D              weights x V  2 N N D
      MLP          2 * 2 N D (r D)      head    2 N D (C_out p^2)
    Norms, softmax, GELU and adds are ignored (memory bound, < 2% of the FLOPs here).
    """
    N = (img_size[0] // patch_size) * (img_size[1] // patch_size)
    D, hidden = embed_dim, int(embed_dim * mlp_ratio)
    patch = 2 * N * in_chans * patch_size**2 * D
    block = 2 * N * D * 3 * D + 2 * N * D * D + 2 * 2 * N * N * D + 2 * 2 * N * D * hidden
    head = 2 * N * D * out_chans * patch_size**2
    return 3 * (patch + depth * block + head)


def vit_from_params(cfg: Config, layers: Any = None) -> VisionTransformer:
    """Build the model from a config. `layers`: the layer factory, serial by default; a
    tensor/context-parallel layout passes `distributed.layers.DistributedLayers()`."""
    return VisionTransformer(
        num_heads=cfg.num_heads, dropout=cfg.dropout, layers=layers, **config_keys(cfg))

