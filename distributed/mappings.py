"""Differentiable collectives: each forward has the backward that makes autograd exact.

The pairs are conjugate: the backward of a forward collective is its adjoint.

    function                                        forward            backward
    copy_to_parallel_region                         identity           all-reduce (sum)
    reduce_from_parallel_region                     all-reduce (sum)   identity
    scatter_to_parallel_region                      keep my chunk      all-gather
    gather_from_parallel_region(backward="split")   all-gather         keep my chunk
    gather_from_parallel_region(backward="reduce_scatter")
                                                    all-gather         reduce-scatter (sum)

Which backward a gather needs depends on what the ranks do with the gathered tensor. If they
compute the *same* thing with it (e.g. the head on all tokens), each already holds the full
gradient and keeps its chunk ("split"). If they compute *different* things with it (cp
attention: my queries against everyone's keys), the gradients are summed over the ranks and
each keeps its chunk of the sum ("reduce_scatter").

Chunks along `dim` follow `helpers.compute_split_shapes` (uneven allowed, first ones bigger);
gathers take the per-rank lengths `sizes` when known (exchanged otherwise). Every function is
the identity when the group has size 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from distributed import comm
from distributed.helpers import (
    all_gather_along_dim,
    all_reduce,
    compute_split_shapes,
    exchange_sizes,
    reduce_scatter_along_dim,
)


def _my_chunk(x: torch.Tensor, dim: int, group_name: str, sizes: Sequence[int]) -> torch.Tensor:
    return torch.split(x, list(sizes), dim=dim)[comm.get_rank(group_name)].contiguous()


class _CopyToParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return all_reduce(grad.contiguous().clone(), ctx.group_name), None


class _ReduceFromParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str) -> torch.Tensor:
        return all_reduce(x.contiguous().clone(), group_name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


class _ScatterToParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
        ctx.dim, ctx.group_name = dim, group_name
        ctx.sizes = compute_split_shapes(x.shape[dim], comm.get_size(group_name))
        return _my_chunk(x, dim, group_name, ctx.sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return all_gather_along_dim(grad, ctx.dim, ctx.group_name, ctx.sizes), None, None


class _GatherFromParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group_name: str,
                sizes: Sequence[int] | None) -> torch.Tensor:
        if sizes is None:
            sizes = exchange_sizes(x.shape[dim], group_name, x.device)
        ctx.dim, ctx.group_name, ctx.sizes = dim, group_name, list(sizes)
        return all_gather_along_dim(x, dim, group_name, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _my_chunk(grad, ctx.dim, ctx.group_name, ctx.sizes), None, None, None


class _GatherFromParallelRegionReduceScatter(_GatherFromParallelRegion):
    """The gather's forward; the backward sums the gradients of every rank's copy."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return reduce_scatter_along_dim(grad, ctx.dim, ctx.group_name, ctx.sizes), None, None, None


def copy_to_parallel_region(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Enter a parallel region with a replicated input: identity / all-reduce of the grad."""
    if comm.get_size(group_name) == 1:
        return x
    return _CopyToParallelRegion.apply(x, group_name)


def reduce_from_parallel_region(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Leave a parallel region by summing the ranks' partial results / identity."""
    if comm.get_size(group_name) == 1:
        return x
    return _ReduceFromParallelRegion.apply(x, group_name)


def scatter_to_parallel_region(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """Keep this rank's chunk of a replicated tensor / all-gather of the grad."""
    if comm.get_size(group_name) == 1:
        return x
    return _ScatterToParallelRegion.apply(x, dim % x.dim(), group_name)


def gather_from_parallel_region(x: torch.Tensor, dim: int, group_name: str,
                                sizes: Sequence[int] | None = None,
                                backward: str = "split") -> torch.Tensor:
    """All-gather chunks along `dim` into a replicated tensor. Backward: "split" keeps this
    rank's chunk of the gradient (the ranks use the result identically), "reduce_scatter"
    sums the ranks' gradients first (they use it differently). `sizes`: every rank's
    length along `dim`, exchanged when not given."""
    if backward not in _GATHERS:
        raise ValueError(f"backward must be 'split' or 'reduce_scatter', got {backward!r}")
    if comm.get_size(group_name) == 1:
        return x
    return _GATHERS[backward].apply(x, dim % x.dim(), group_name, sizes)


_GATHERS = {"split": _GatherFromParallelRegion,
            "reduce_scatter": _GatherFromParallelRegionReduceScatter}
