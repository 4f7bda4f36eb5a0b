"""Splitting, collectives with uneven shapes, and the parameter-annotation scheme.

Collectives with gloo (torch 2.13): `all_gather_into_tensor` / `reduce_scatter_tensor`
(renamed `all_gather_single` / `reduce_scatter_single`) work on CPU, but, like the list
versions, only for equal shapes on every rank. Uneven splits (7 tokens over 2 ranks) are
therefore padded to the largest chunk, exchanged with the single-tensor collective, and
trimmed. The same code runs unchanged on NCCL.

Under torch.compile the collectives name their group by its string name (functional
collectives, torch.distributed._functional_collectives): Dynamo would otherwise turn an
in-place `dist.all_reduce(x, group=pg)` into a functional one that takes the group object as
a graph input, and PyTorch 2.13 keeps such a graph alive after the run (a backward node of
the compiled autograd Function outlives it), and with it the group and gloo's threads, into
interpreter exit (tests/test_compiled_model_parallel.py). Eagerly, and in CUDA graphs, the
in-place c10d collectives run as they are; both paths give the same sums.

Parameter annotations (set with `annotate`, read by `sync_shared_gradients`):
    param.sharded_dims_mp  per tensor dim, the group it is split over, or None
    param.shard_blocks     the sharded dim is a concatenation of this many equal blocks, each
                           split separately (the fused qkv: [q | k | v])
    param.is_shared_mp     groups over which the parameter is replicated (identical copies):
                           every model-parallel axis (utils.parallel_axes) that does not
                           shard it
    param.partial_grad_mp  groups over which each rank's gradient is only a *partial sum*,
                           because the ranks apply the parameter to different tokens (cp) or
                           grid points (h, w). Always a subset of is_shared_mp.
A model-parallel model must annotate every parameter: `check_annotations` enforces it once,
when the model is built, and `sync_shared_gradients` plans its reductions from it.

Why tp is not in partial_grad_mp of replicated parameters (norms, row-parallel biases): the
Megatron conjugate pair copy_to/reduce_from all-reduces the activation gradient over tp where
the tensor-parallel region begins, so every tp rank already holds the full gradient of its
replicated parameters. Summing it over tp again would multiply it by tp.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from distributed import comm, fsdp
from utils.parallel_axes import MODEL_PARALLEL

# torch 2.13 renamed the single-tensor collectives; keep working on older releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def compute_split_shapes(size: int, num_chunks: int) -> list[int]:
    """Sizes of `num_chunks` nearly equal chunks of `size`; the first ones are one bigger.

    compute_split_shapes(4050, 4) == [1013, 1013, 1012, 1012]; (7, 2) -> [4, 3].
    """
    if num_chunks < 1 or size < num_chunks:
        raise ValueError(f"cannot split {size} elements into {num_chunks} non-empty chunks")
    base, extra = divmod(size, num_chunks)
    return [base + 1 if i < extra else base for i in range(num_chunks)]


def exchange_sizes(local: int, group_name: str, device: torch.device) -> list[int]:
    """Every rank's `local` integer (a small all-gather and a host sync: avoid in hot loops)."""
    world = comm.get_size(group_name)
    buf = torch.empty(world, dtype=torch.int64, device=device)
    _all_gather_single(buf, torch.tensor([local], device=device), group=comm.get_group(group_name))
    return buf.tolist()


def all_gather_along_dim(x: torch.Tensor, dim: int, group_name: str,
                         sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`; `sizes` are the ranks' lengths along `dim`
    (exchanged when not given). Not differentiable: see distributed.mappings."""
    world = comm.get_size(group_name)
    if world == 1:
        return x
    dim = dim % x.dim()
    sizes = list(sizes) if sizes is not None else exchange_sizes(x.shape[dim], group_name,
                                                                 x.device)
    if len(sizes) != world or sizes[comm.get_rank(group_name)] != x.shape[dim]:
        raise ValueError(f"sizes {sizes} do not match the local length {x.shape[dim]} "
                         f"on {group_name} rank {comm.get_rank(group_name)}")
    width = max(sizes)
    local = x.movedim(dim, 0)
    if local.shape[0] < width:
        local = torch.cat([local, local.new_zeros((width - local.shape[0], *local.shape[1:]))])
    if torch.compiler.is_compiling():  # by the group's name (module docstring)
        buf = funcol.all_gather_tensor(local.contiguous(), 0, comm.get_group_name(group_name))
    else:
        buf = local.new_empty((world * width, *local.shape[1:]))
        _all_gather_single(buf, local.contiguous(), group=comm.get_group(group_name))
    chunks = [buf[r * width: r * width + n] for r, n in enumerate(sizes)]
    return torch.cat(chunks).movedim(0, dim).contiguous()


def reduce_scatter_along_dim(x: torch.Tensor, dim: int, group_name: str,
                             sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's chunk along `dim` (chunk lengths `sizes`,
    default `compute_split_shapes`). Not differentiable: see distributed.mappings."""
    world = comm.get_size(group_name)
    if world == 1:
        return x
    dim = dim % x.dim()
    sizes = list(sizes) if sizes is not None else compute_split_shapes(x.shape[dim], world)
    if len(sizes) != world or sum(sizes) != x.shape[dim]:
        raise ValueError(f"sizes {sizes} do not split length {x.shape[dim]} over {world} ranks")
    width = max(sizes)
    full = x.movedim(dim, 0)
    buf = full.new_zeros((world * width, *full.shape[1:]))
    for r, chunk in enumerate(torch.split(full, sizes)):
        buf[r * width: r * width + sizes[r]] = chunk
    if torch.compiler.is_compiling():  # by the group's name (module docstring)
        out = funcol.reduce_scatter_tensor(buf, "sum", 0, comm.get_group_name(group_name))
    else:
        out = buf.new_empty((width, *full.shape[1:]))
        _reduce_scatter_single(out, buf, group=comm.get_group(group_name))
    return out[: sizes[comm.get_rank(group_name)]].movedim(0, dim).contiguous()


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of `x` over the group. Eagerly it is written into `x` (returned); compiled it
    is a new tensor: pass an `x` that is not needed afterwards, and use the result."""
    if comm.get_size(group_name) == 1:
        return x
    if torch.compiler.is_compiling():  # by the group's name (module docstring)
        return funcol.all_reduce(x, "sum", comm.get_group_name(group_name))
    dist.all_reduce(x, group=comm.get_group(group_name))
    return x


# ----------------------------------------------------------------------------- annotations

def annotate(param: torch.Tensor, sharded_dims: Sequence[str | None] | None = None,
             partial_grad: Iterable[str] = (), blocks: int = 1) -> None:
    """Record how `param` is laid out over the model-parallel groups (see module docstring):
    `sharded_dims` names, per dim, the group that splits it (None: whole); every other
    model-parallel group holds a replica; `partial_grad` lists the replica groups whose
    ranks apply it to different tokens or grid points."""
    param.sharded_dims_mp = list(sharded_dims) if sharded_dims is not None else [None] * param.dim()
    param.is_shared_mp = [g for g in MODEL_PARALLEL if g not in param.sharded_dims_mp]
    param.partial_grad_mp = list(partial_grad)
    param.shard_blocks = blocks


def annotation_errors(model: nn.Module) -> list[str]:
    """Every way in which `model`'s parameters break the annotation rules (empty if none)."""
    errors = []
    for name, p in model.named_parameters():
        if not all(hasattr(p, a) for a in ("is_shared_mp", "partial_grad_mp", "sharded_dims_mp")):
            errors.append(f"{name}: not annotated (use distributed.helpers.annotate)")
            continue
        if len(p.sharded_dims_mp) != p.dim():
            errors.append(f"{name}: sharded_dims_mp has {len(p.sharded_dims_mp)} entries "
                          f"for a {p.dim()}-d tensor")
        if not set(p.partial_grad_mp) <= set(p.is_shared_mp):
            errors.append(f"{name}: partial_grad_mp {sorted(p.partial_grad_mp)} is not within "
                          f"is_shared_mp {sorted(p.is_shared_mp)}")
    return errors


def check_annotations(model: nn.Module) -> None:
    errors = annotation_errors(model)
    if errors:
        raise RuntimeError("model-parallel annotations are broken:\n  " + "\n  ".join(errors))


def sync_shared_gradients(model: nn.Module) -> None:
    """Sum the partial gradients of replicated parameters over their partial_grad_mp groups
    (cp for the ViT, h and w for the spatially parallel AFNO).

    The one place where model-parallel gradient reductions happen. Call it after
    `loss.backward()` and before `optimizer.step()`. It commutes with DDP's average over dp
    (a sum over cp and a mean over dp are both linear), so it can run after DDP's backward.
    A no-op on a model that is not model-parallel. Which parameters go to which group is
    planned once per model (annotations are checked then, `check_annotations`).
    """
    if comm.get_size("mp") == 1:
        return
    plan = getattr(model, "_grad_sync_plan", None)
    if plan is None:
        check_annotations(model)
        plan = [(group_name, [p for p in model.parameters() if group_name in p.partial_grad_mp])
                for group_name in MODEL_PARALLEL if comm.get_size(group_name) > 1]
        model._grad_sync_plan = plan
    for group_name, params in plan:
        all_reduce_grads(params, group_name)


def sum_gradients_over(model: nn.Module, group_name: str) -> None:
    """Sum every parameter's gradient over the ranks of `group_name`, in place (ensemble
    parallelism: each ens rank's gradient comes from its own members' part of the loss, and
    the full gradient is the sum over the members, so over the ens ranks). Call it after
    backward, before the optimizer step; like `sync_shared_gradients`, it commutes with
    DDP's average over dp (both linear)."""
    if comm.get_size(group_name) > 1:
        all_reduce_grads(list(model.parameters()), group_name)


# Gradients summed in messages of at most this many bytes (DDP's default bucket): one message
# per parameter would pay a collective's latency ~100 times a step; one for all of them would
# copy every gradient at once.
BUCKET_BYTES = 25 * 1024 * 1024


def all_reduce_grads(params: Sequence[torch.Tensor], group_name: str,
                     bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum the gradients of `params` over `group_name`, in place: flattened into buckets of
    one dtype and at most `bucket_bytes` (a larger gradient is a bucket of its own), one
    all-reduce each. Under FSDP each rank sums its slice of every gradient."""
    buckets: list[list[torch.Tensor]] = []
    open_bucket: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
    for p in params:  # under FSDP, this rank's slice of the gradient (distributed/fsdp.py)
        if p.grad is None:
            continue
        grad = fsdp.local(p.grad)
        bucket, size = open_bucket.get(grad.dtype, ([], 0))
        if bucket and size + grad.numel() * grad.element_size() > bucket_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append(grad)
        open_bucket[grad.dtype] = (bucket, size + grad.numel() * grad.element_size())
    buckets += [bucket for bucket, _ in open_bucket.values() if bucket]
    for grads in buckets:
        flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), group_name)
        for g, reduced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(reduced.view_as(g))


# ------------------------------------------------------------------- sharding and gathering

def shard_tensor(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the serial tensor `full`, laid out like `param`."""
    out = full
    for dim, group_name in enumerate(getattr(param, "sharded_dims_mp", [])):
        if group_name is None or comm.get_size(group_name) == 1:
            continue
        world, rank, blocks = comm.get_size(group_name), comm.get_rank(group_name), \
            param.shard_blocks
        if blocks == 1:  # one block: uneven splits allowed (the spatial tiles of pos_embed)
            out = out.split(compute_split_shapes(out.shape[dim], world), dim=dim)[rank]
            continue
        if out.shape[dim] % (blocks * world):
            raise ValueError(f"dim {dim} of size {out.shape[dim]} does not split into "
                             f"{blocks} blocks x {world} {group_name} ranks")
        per_block = out.shape[dim] // blocks
        pieces = [b.chunk(world, dim=dim)[rank] for b in out.split(per_block, dim=dim)]
        out = torch.cat(pieces, dim=dim)
    return out.contiguous()


def gather_tensor(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Inverse of `shard_tensor`: the serial-layout tensor from every rank's `local` shard
    (for the parameter itself, its gradient or an optimizer state of the same shape)."""
    out = local
    for dim, group_name in enumerate(getattr(param, "sharded_dims_mp", [])):
        if group_name is None or comm.get_size(group_name) == 1:
            continue
        world, blocks = comm.get_size(group_name), param.shard_blocks
        gathered = all_gather_along_dim(out, dim, group_name)
        if blocks == 1:  # already in serial order (and possibly uneven)
            out = gathered
            continue
        # rank-major [r0: b0 b1 b2 | r1: b0 b1 b2] -> block-major [b0: r0 r1 | b1: r0 r1 | ...]
        ranks = gathered.chunk(world, dim=dim)
        parts = [ranks[r].chunk(blocks, dim=dim)[b] for b in range(blocks) for r in range(world)]
        out = torch.cat(parts, dim=dim)
    return out
