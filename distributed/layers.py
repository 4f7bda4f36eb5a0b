"""Tensor- and context-parallel versions of the ViT's layers (Megatron-style).

Tensor parallel (tp): a column-parallel matmul splits its output features (each rank computes
some heads / some MLP hidden units) and a row-parallel matmul splits its input features and
sums the partial products. Column then row needs one all-reduce per block half and no
communication in between. Context parallel (cp): each rank holds a contiguous slice of the
tokens; attention all-gathers k and v so local queries see every key.

Each rank allocates only its shard. Every parameter is annotated (distributed.helpers) with
how it is laid out; `sync_shared_gradients(model)` uses that to finish its gradient.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed import comm
from distributed.helpers import (
    annotate,
    compute_split_shapes,
    shard_tensor,
)
from distributed.mappings import (
    copy_to_parallel_region,
    gather_from_parallel_region,
    reduce_from_parallel_region,
    scatter_to_parallel_region,
)
from networks.kernels import attention
from networks.noise import NoiseEmbed, NoiseModulation


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (the output features) split over `group_name`.

    W_local is (out/tp, in). The input is replicated: copy_to_parallel_region makes the
    backward all-reduce its gradient. The output stays split along the last dim, ready for a
    RowParallelLinear. `blocks` > 1 splits each of that many equal output blocks separately
    (the fused qkv: every rank gets its heads' q, k and v). `seq_group`: the group the
    tokens are split over; gradients are partial sums over it.
    Weights are allocated here, not initialised: the layer factory does that (same numbers
    as the serial model, `networks.blocks.init_weights`).
    """

    def __init__(self, in_features: int, out_features: int, group_name: str = "tp",
                 blocks: int = 1, seq_group: str = "cp"):
        super().__init__()
        self.group_name = group_name
        out_local = blocks * (out_features // blocks // comm.get_size(group_name))
        self.weight = nn.Parameter(torch.empty(out_local, in_features))
        self.bias = nn.Parameter(torch.empty(out_local))
        annotate(self.weight, [group_name, None], [seq_group], blocks)
        annotate(self.bias, [group_name], [seq_group], blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_parallel_region(x, self.group_name), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns (the input features) split over `group_name`.

    W_local is (out, in/tp). The input arrives split along its last dim (a column-parallel
    layer's output); the partial products are summed with reduce_from_parallel_region,
    *then* the bias, whole on every rank, is added once.
    """

    def __init__(self, in_features: int, out_features: int, group_name: str = "tp",
                 seq_group: str = "cp"):
        super().__init__()
        self.group_name = group_name
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features // comm.get_size(group_name)))
        self.bias = nn.Parameter(torch.empty(out_features))
        annotate(self.weight, [None, group_name], [seq_group])
        annotate(self.bias, None, [seq_group])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_parallel_region(F.linear(x, self.weight), self.group_name) + self.bias


class DistributedMLP(nn.Module):
    """fc1 column-parallel -> GELU on the local hidden units -> fc2 row-parallel."""

    def __init__(self, dim: int, hidden_dim: int, dropout: float = 0.0):
        super().__init__()
        self.fc1 = ColumnParallelLinear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = RowParallelLinear(hidden_dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class TokenSplit:
    """Splits the token sequence over cp and remembers the (possibly uneven) lengths, so the
    attention layers can all-gather k and v without first exchanging lengths."""

    def __init__(self) -> None:
        self.sizes: list[int] | None = None

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, D) replicated -> (B, N_local, D)."""
        self.sizes = compute_split_shapes(x.shape[1], comm.get_size("cp"))
        return scatter_to_parallel_region(x, 1, "cp")

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N_local, D) -> (B, N, D) on every rank."""
        return gather_from_parallel_region(x, 1, "cp", self.sizes)


class DistributedAttention(nn.Module):
    """Self-attention with heads split over tp and tokens split over cp.

    The local fused qkv holds [q | k | v] for this rank's heads. Each cp rank attends with
    its own queries to the keys and values of all tokens: k and v are all-gathered over cp
    (one collective for both; its backward reduce-scatters their gradients). No mask is
    needed (the ViT attends to every token), so plain attention runs locally.
    """

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0,
                 tokens: TokenSplit | None = None):
        super().__init__()
        self.num_heads = num_heads // comm.get_size("tp")  # checked at start-up: divides
        self.head_dim = dim // num_heads
        self.qkv = ColumnParallelLinear(dim, 3 * dim, blocks=3)
        self.proj = RowParallelLinear(dim, dim)
        self.dropout = dropout
        self.tokens = tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape  # N: local tokens
        qkv = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim)
        sizes = self.tokens.sizes if self.tokens is not None else None
        # (B, N_all, 2, heads, head_dim); every rank uses all of it differently: its gradient
        # is summed over cp and split back (reduce-scatter).
        kv = gather_from_parallel_region(qkv[:, :, 1:], 1, "cp", sizes, backward="reduce_scatter")
        q = qkv[:, :, 0].transpose(1, 2)  # (B, heads, N, head_dim)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, heads, N_all, head_dim)
        dropout_p = self.dropout if self.training else 0.0
        x = attention(q, k, v, dropout_p=dropout_p)  # the serial model's precision policy
        return self.proj(x.transpose(1, 2).reshape(B, N, -1))


class DistributedLayerNorm(nn.LayerNorm):
    """LayerNorm with replicated parameters. It normalises each token on its own, so it needs
    no communication; its gradient is a partial sum over cp (local tokens only), which
    `sync_shared_gradients` completes. Over tp it is already complete (see helpers)."""

    def __init__(self, dim: int, seq_group: str = "cp"):
        super().__init__(dim)
        for p in (self.weight, self.bias):
            annotate(p, None, [seq_group])


def per_token(module: nn.Module, seq_group: str = "cp") -> nn.Module:
    """`module` with its parameters annotated as replicated and applied to each rank's own
    tokens: their gradients are partial sums over `seq_group` (returned for chaining)."""
    for p in module.parameters():
        annotate(p, None, [seq_group])
    return module


class DistributedLayers:
    """Drop-in for `networks.vit.SerialLayers`: tp/cp layers, the cp token split, and the
    sharded initialisation (draw the serial tensor, keep this rank's part)."""

    def __init__(self) -> None:
        self.tokens = TokenSplit()

    def attention(self, dim: int, num_heads: int, dropout: float) -> nn.Module:
        return DistributedAttention(dim, num_heads, dropout, self.tokens)

    def mlp(self, dim: int, hidden_dim: int, dropout: float) -> nn.Module:
        return DistributedMLP(dim, hidden_dim, dropout)

    def norm(self, dim: int) -> nn.Module:
        return DistributedLayerNorm(dim)

    # An ensemble member's noise conditioning acts on each token on its own, as the norms do:
    # every rank holds it whole and applies it to its own tokens (a partial gradient over cp).
    def noise_embed(self, noise_channels: int, cond_dim: int) -> nn.Module:
        return per_token(NoiseEmbed(noise_channels, cond_dim))

    def noise_modulation(self, cond_dim: int, dim: int) -> nn.Module:
        return per_token(NoiseModulation(cond_dim, dim))

    def scatter_tokens(self, x: torch.Tensor) -> torch.Tensor:
        return self.tokens.scatter(x)

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        return self.tokens.gather(x)

    def replicated(self, *parts: nn.Module | nn.Parameter) -> None:
        """Annotate parameters that every rank holds whole and applies to *all* tokens
        (patch embedding, pos_embed, head): their gradients are complete everywhere."""
        for part in parts:
            for p in part.parameters() if isinstance(part, nn.Module) else [part]:
                annotate(p)

    def full_shape(self, param: torch.Tensor) -> list[int]:
        shape = list(param.shape)
        for dim, group in enumerate(getattr(param, "sharded_dims_mp", [])):
            if group is not None:
                shape[dim] *= comm.get_size(group)
        return shape

    def local_part(self, full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        return shard_tensor(full, param)
