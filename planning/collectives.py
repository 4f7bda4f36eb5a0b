"""Every collective a training step makes, counted where they all pass: the c10d operators.

    with CollectiveRecorder() as recorder:
        step(run, inp, tar)
    recorder.collectives          # [Collective(op, group, nbytes), ...] in the order called
    counted(recorder.collectives) # {(op, group, nbytes): count}

Whatever calls a collective (the tensor- and context-parallel autograd Functions, the
distributed FFT's all-to-alls, FSDP2, DDP's reducer from C++), torch.distributed turns it
into one of the `c10d` operators, and a `TorchDispatchMode` sees each with its process group
and its tensors, on real tensors of a gloo or NCCL job and on the fake tensors of a dry run
alike: the same recorder counts both (tests/test_dry_run.py compares them).

`nbytes` is the payload S of the textbook costs (planning/time_model.py): the tensor of an
all-reduce or a broadcast; the gathered output of an all-gather; the input of a
reduce-scatter (before it is reduced and scattered); what this rank hands an all-to-all
(its own chunk included). Bytes are elements x element size of the tensor as the operator
sees it (a view counts its elements, not its storage).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# c10d operator -> (the collective, the argument that holds its payload S; None: no data)
C10D_OPS: dict[str, tuple[str, str | None]] = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "_allgather_base_": ("all_gather", "output_tensor"),
    "allgather_": ("all_gather", "output_tensors"),
    "allgather_coalesced_": ("all_gather", "output_lists"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "alltoall_base_": ("all_to_all", "input"),
    "alltoall_": ("all_to_all", "input_tensors"),
    "broadcast_": ("broadcast", "tensors"),
    "reduce_": ("reduce", "tensors"),
    "barrier": ("barrier", None),
}


# The arguments of c10d operators that receive a collective's result.
RESULTS = ("tensors", "output_tensor", "output_tensors", "outputs", "output_lists", "output")


@dataclass(frozen=True)
class Collective:
    """One collective call on this rank: what it does, over which ranks, with how much."""

    op: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, reduce, barrier
    group: tuple[int, ...]  # the group's global ranks, in group-rank order
    nbytes: int  # the payload S (module docstring)


def tensor_bytes(value: Any) -> int:
    """Elements x element size of a tensor, or of every tensor in (nested) lists of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


class CollectiveRecorder(TorchDispatchMode):
    """Records every c10d collective called while it is active (`collectives`), then runs
    it unchanged. Subclasses see every other operator in `other` (planning/step_trace.py
    counts the step's compute there)."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[Collective] = []
        self._ranks: dict[str, tuple[int, ...]] = {}  # group name -> its ranks

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - the hook
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            # positional arguments (defaults left out are not payloads), then keywords
            named = dict(zip((a.name for a in func._schema.arguments), args, strict=False))
            named.update(kwargs)
            self.collective(self.describe(func, named), named)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        self.other(func, args, kwargs, out)
        return out

    def collective(self, call: Collective, named: dict[str, Any]) -> None:
        """One collective (`named`: the operator's arguments by name)."""
        self.collectives.append(call)

    def other(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Any operator but a collective (nothing to do here)."""

    def describe(self, func: Any, named: dict[str, Any]) -> Collective:
        """The Collective of one call of the c10d operator `func`."""
        name = func._schema.name.split("::")[-1]
        op, payload = C10D_OPS.get(name, (name, None))
        return Collective(op, self.ranks(named["process_group"]),
                          tensor_bytes(named[payload]) if payload else 0)

    def ranks(self, boxed: Any) -> tuple[int, ...]:
        """The global ranks of the process group an operator received (boxed for C++)."""
        group = dist.ProcessGroup.unbox(boxed)
        if group.group_name not in self._ranks:
            self._ranks[group.group_name] = tuple(dist.get_process_group_ranks(group))
        return self._ranks[group.group_name]


def counted(collectives: Iterable[Collective]) -> Counter:
    """How many times each (op, group, nbytes) was called: a step's collectives as the
    comparison of a dry run with a real job counts them."""
    return Counter((c.op, c.group, c.nbytes) for c in collectives)
