"""One process acting as rank r of a job of N: PyTorch's fake process-group backend.

    with fake_world(1024, rank=5):
        comm.init(order, tp=4)        # the job's own groups, made here for rank 5
        ...                           # the real layout, model and step code

Collectives on the fake backend return at once and move nothing; with fake tensors
(`FakeTensorMode`) nothing is computed or allocated either, so the code the train scripts
run builds and steps a job of 1,024 ranks in a laptop's process. What cannot run there:
DDP (its reducer waits on real results: planning/step_trace.py writes its buckets down),
a loss scaler's verdict and anything else that reads a value (`.item()`), the store's
set/get, and object collectives.

Within `fake_world`, FSDP2's set-up makes only the chunks it reads (`chunks_on_demand`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from distributed import comm
from distributed.startup_checks import TESTED_TORCH
from utils.errors import UserError


def runs_collectives_on_fake_tensors() -> bool:
    """Whether this PyTorch has fake (meta) kernels for the c10d collectives: newer releases
    register them, 2.7 does not (its collectives stop a fake step at the first call)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_", "Meta")


def require_collectives_on_fake_tensors() -> None:
    """A UserError (one line) on a PyTorch that cannot run collectives on fake tensors."""
    if not runs_collectives_on_fake_tensors():
        raise UserError(f"PyTorch {torch.__version__} cannot run collectives on fake tensors, "
                        f"which the dry run and the planner need: use a newer PyTorch (tested "
                        f"with {TESTED_TORCH})")


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0, collectives: bool = True) -> Iterator[None]:
    """torch.distributed initialised as rank `rank` of `world_size` on the fake backend for
    the duration (this process must have no process group of its own); ended with every
    group the block made (`comm.shutdown`). On a PyTorch that cannot run collectives on
    fake tensors, a UserError says so, unless `collectives` is False: a block that only
    builds (groups, FSDP2's set-up) runs on every PyTorch."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if collectives:
        require_collectives_on_fake_tensors()
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is initialised in this process already: a "
                           "fake world needs the process to itself")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with chunks_on_demand():
            yield
    finally:
        comm.shutdown()


class _Chunks(Sequence):
    """`torch.chunk(tensor, n, dim)` padded with empty tensors to n chunks (FSDP2's
    `_chunk_with_empty`), each chunk the same view torch.chunk returns, made when read."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int):
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim
        self.length = tensor.shape[dim]
        self.step = -(-self.length // num_chunks)  # torch.chunk's chunk length

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]
        if not -self.num_chunks <= i < self.num_chunks:
            raise IndexError(i)
        start = (i % self.num_chunks) * self.step
        if start >= self.length and start > 0:  # beyond torch.chunk's chunks: padding
            return self[0].new_empty(0)
        return self.tensor.narrow(self.dim, start, min(self.step, self.length - start))


@contextlib.contextmanager
def chunks_on_demand() -> Iterator[None]:
    """FSDP2's set-up cuts every parameter into one chunk per rank and reads two of them
    (this rank's, and the first for the padded size). On fake tensors each chunk costs
    tens of microseconds: at dp 1,024 that is most of a model's set-up. Within the block,
    chunks are made when read. A PyTorch whose FSDP2 has no such helper is left as it is
    (only slower); tests/test_dry_run.py checks the collectives against real runs."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:
        yield
        return
    original = getattr(_fsdp_param, "_chunk_with_empty", None)
    if original is None:
        yield
        return
    _fsdp_param._chunk_with_empty = _Chunks
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original
