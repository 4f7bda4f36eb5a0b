"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the
data-parallel ranks, in place of DDP's replicas (`--fsdp`; docs/memory.md says when).

DDP keeps on every rank the whole model, its gradients and Adam's two moments: 16 bytes per
parameter in fp32. FSDP keeps 1/dp of each (one dim of every tensor split over the dp group,
`shard_dim`) and, around each block's forward and backward, all-gathers that block's
parameters; after
the block's backward it reduce-scatters the gradients (the sum DDP's all-reduce computes,
each rank keeping its shard of it, averaged over dp as DDP does). `fully_shard` is applied
to every block, then to the whole model (patch embedding, position embedding, final norm
and head gather with it), so at most a block or two are whole at any time.

On a model-parallel layout each rank's tensors are its tp shard or its tile's copy, plain
tensors (the tp/cp and spatial layers are written by hand, not with DTensor): FSDP shards
those local tensors again over the layout's dp group, a one-dimensional device mesh of this
rank's dp ranks. The ranks of a model-parallel group share their dp rank, so they hold the
same slice of each shard: the sums of partial gradients over cp, h and w
(`distributed.helpers.sync_shared_gradients`) run after FSDP's reduce-scatter, on these
slices, 1/dp of the bytes they would move before it (both are linear: the order does not
change the result).

Precision: the forward runs under autocast (utils/precision.py), which casts each
parameter for each op, as with DDP. FSDP therefore gathers fp32 parameters and reduces fp32
gradients (its default `MixedPrecisionPolicy`): the same numbers as DDP in every `amp_mode`,
at twice the gather bytes of a bf16 gather. Gathering in bf16/fp16 instead would change
what autocast keeps in fp32 (the LayerNorms, the AFNO's spectral filter, which runs in fp32
by design) and so the training itself.

FSDP2 asks the reduce-scatter for the mean of fp32 gradients (ReduceOp.AVG). Gloo in PyTorch
2.7 accepts that op and returns the sum, so on a CPU every gradient came out dp times too
large; where a probe of the group finds that, each FSDP module divides its reduced
gradients by dp after the reduce-scatter (`set_all_reduce_hook`, FSDP2's hook for that
place). NCCL averages; newer gloo averages too.

fully_shard replaces each parameter by a DTensor: `keep_annotations` carries the
model-parallel annotations (distributed/helpers.py) over to it by name, and `local` gives
the plain tensor of this rank's shard (what sums and checks work on).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from utils.model_wrappers import uncompiled

# What distributed/helpers.py and distributed/spatial.py record on a parameter.
ANNOTATIONS = ("sharded_dims_mp", "is_shared_mp", "partial_grad_mp", "shard_blocks",
               "full_shape")


def mesh_of(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """The one-dimensional device mesh of `group`'s ranks (the layout's dp group)."""
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("dp",))


def shard_model(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True
                ) -> nn.Module:
    """`model` with every block, then the whole, sharded over the ranks of `mesh` (in
    place; returned for chaining). `reshard_after_forward` False keeps each block's
    gathered parameters from its forward to its backward (one all-gather less per block)."""
    options = {"mp_policy": MixedPrecisionPolicy()}  # fp32 gathers, reductions: docstring
    if "shard_placement_fn" in inspect.signature(fully_shard).parameters:
        ranks = mesh.size()
        options["shard_placement_fn"] = lambda param: Shard(shard_dim(param.shape, ranks))
    with keep_annotations(model):
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward,
                        **options)
        # The root's own parameters stay gathered from forward to backward (FSDP2's choice
        # for a root: its backward starts right after its forward).
        fully_shard(model, mesh=mesh, **options)
    model.blocks_reshard_after_forward = reshard_after_forward  # for `gathered`
    group = mesh.get_group()
    if sums_when_asked_to_average(group):  # the module docstring says which PyTorch
        size = dist.get_world_size(group)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(lambda grads: grads.div_(size))
    return model


def sums_when_asked_to_average(group: dist.ProcessGroup) -> bool:
    """Whether `group`'s reduce-scatter returns the sum when asked for the mean (gloo in
    PyTorch 2.7): a probe, one reduce-scatter of `size` ones (collective over the group;
    only gloo groups are probed)."""
    if dist.get_backend(group) != "gloo" or dist.get_world_size(group) == 1:
        return False
    out = torch.zeros(1)
    dist.reduce_scatter_tensor(out, torch.ones(dist.get_world_size(group)),
                               op=dist.ReduceOp.AVG, group=group)
    return out.item() > 1.5  # the mean of ones is 1, their sum the group's size


def shard_dim(shape: torch.Size | tuple[int, ...], ranks: int) -> int:
    """The dim FSDP splits a parameter of `shape` along over `ranks` ranks: of the dims
    FSDP2 can split, the one that leaves the least padding (the first of equals).

    FSDP2 splits dim 0 into any number of slices, padding every rank's slice to the first
    one's size; any other dim only into equal slices (it refuses an uneven one, in every
    release since 2.7). So a dim after the first qualifies where `ranks` divides it, and
    dim 0 always does. Split along a dim shorter than `ranks`, each rank would hold (and
    gather) a slice of the first one's size: `pos_embed` (1, N, D) and the AFNO's spectral
    weights (2, blocks, ...) split along dim 0 cost dp times their bytes on every rank,
    which a later dim that `ranks` divides avoids."""
    numel = math.prod(shape)
    if numel == 0 or len(shape) == 0:
        return 0
    splittable = [0] + [d for d in range(1, len(shape)) if shape[d] % ranks == 0]
    return min(splittable, key=lambda d: (-(-shape[d] // ranks) * (numel // shape[d]), d))


@contextlib.contextmanager
def keep_annotations(model: nn.Module) -> Iterator[None]:
    """The model-parallel annotations of every parameter, set again on the parameter of the
    same name after the block (which replaces parameters)."""
    kept = {name: {a: getattr(p, a) for a in ANNOTATIONS if hasattr(p, a)}
            for name, p in model.named_parameters()}
    yield
    for name, p in model.named_parameters():
        for attribute, value in kept[name].items():
            setattr(p, attribute, value)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor as a plain tensor sharing its memory; any other
    tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def gather(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (over the dp group) of a sharded parameter, gradient or optimizer
    state: collective over the ranks that shard it. Any other tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`whole`, a tensor of `param`'s unsharded shape on every rank, cut as `param` is
    sharded (no communication: every rank keeps its slice)."""
    if not isinstance(param, DTensor):
        return whole
    return distribute_tensor(whole.to(param.device), param.device_mesh, param.placements,
                             src_data_rank=None)


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Every parameter of a sharded `model` whole on every rank for the duration (no-op for
    another model): forward passes without backward then need no collective over dp.
    Validation needs this: data-parallel ranks may hold different numbers of validation
    batches, and a sharded forward would wait for a gather the other ranks never join."""
    model = uncompiled(model)
    if not isinstance(model, FSDPModule):
        yield
        return
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    set_reshard_after_forward(model, False)  # every FSDP module of it
    for m in modules:
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
        for block in model.blocks:
            set_reshard_after_forward(block, model.blocks_reshard_after_forward)


def set_reshard_after_forward(module: nn.Module, value: bool) -> None:
    """FSDPModule.set_reshard_after_forward on `module` and every FSDP module inside it.
    PyTorch 2.7 has no such method: there this sets what the method sets in later releases,
    the mesh each parameter group reshards to after forward (none: stay whole), with the
    helper that fully_shard itself uses."""
    if hasattr(module, "set_reshard_after_forward"):
        module.set_reshard_after_forward(value)
        return
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_post_forward_mesh_info

    for m in module.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        if group is not None:
            group.post_forward_mesh_info = _get_post_forward_mesh_info(value, group.mesh_info)
