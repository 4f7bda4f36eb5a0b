"""What a GPU process holds beyond the tensors the planner traces, term by term, each with
where its number comes from (`SOURCES`; docs/memory.md puts them beside the tutorial's runs).

    terms = beyond_tensors(estimate, Workload.of(cfg, local_batch, tile, comms))  # GiB by name
    peak = estimate.peak / GIB + sum(terms.values())       # the process's own use
    fits = peak <= usable_gib(40)                          # what CUDA reports of a 40 GB GPU

Inside PyTorch's caching allocator (`torch.cuda.memory_allocated` counts the first two):
  allocator rounding  a block is a multiple of 512 B; a tensor over 1 MiB gets the 2 MiB-rounded
                      segment cudaMalloc returns whole unless more than 1 MiB is left to split
                      off (`block_bytes`; the trace rounds every live tensor: planning/memory.py)
  cuBLAS workspaces   one per cuBLAS handle and stream, taken from the allocator: the step's
                      forward (main thread) and backward (autograd's thread) use one each
  fragmentation       reserved but unallocated: the free parts of segments still in use, which
                      the allocator cannot return before it raises out of memory
Outside it (device memory the process holds that PyTorch's allocator never sees):
  CUDA context        the driver's context, with lazy module loading (PyTorch's default)
  kernels, libraries  the modules a training step loads (cuBLAS, cuDNN, flash attention, NCCL's
                      and DALI's kernels) and the libraries' own state
  NCCL buffers        per communicator the rank is in: channels x connections x the buffers of
                      NCCL's three protocols; a layout's groups set how many (`communicators`)
  DALI buffers        per pipeline (training and validation): every GPU operator's output
                      buffer for each batch of the prefetch queue
What the whole device shows (NVML's `used`, the tutorial's "Memory usage" lines) adds what the
driver keeps for itself (`driver_reserve_gib`), which CUDA already leaves out of its total.

Defaults are published or documented values; `make gpu-check` measures them on its GPU and
writes a file `bench.memory_plan --memory_terms` reads (`MemoryTerms.load`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from distributed.rank_generator import RankGenerator
from utils.errors import UserError

GIB = 1024**3
MIB = 1024**2

# PyTorch's caching allocator (c10/cuda/CUDACachingAllocator.cpp): block rounding, the largest
# "small" request, a small request's 2 MiB segment, the 20 MiB segment of requests under
# 10 MiB, and the 2 MiB rounding of larger segments.
MIN_BLOCK = 512
SMALL_SIZE = 1 * MIB
SMALL_BUFFER = 2 * MIB
LARGE_BUFFER = 20 * MIB
MIN_LARGE_ALLOC = 10 * MIB
ROUND_LARGE = 2 * MIB

# NCCL's per-connection buffers: Simple (NCCL_BUFFSIZE, 4 MiB), LL128 and LL protocols; one
# connection's allocation, rounded to cuMem's granularity, is 10 MiB (NVIDIA/nccl#1685).
NCCL_CONNECTION_MIB = 10.0


@dataclass(frozen=True)
class MemoryTerms:
    """The values behind each term (GiB unless named otherwise); `SOURCES` says where each
    default comes from, `measured` where this set was measured instead."""

    context_gib: float = 0.40
    kernels_gib: float = 1.14
    cublas_workspace_mib: float = 9.125
    cublas_workspaces: int = 2
    fragmentation: float = 0.045
    nccl_channels: int = 4
    nccl_connections: int = 2
    nccl_communicator_mib: float = 0.0  # measured: replaces channels x connections
    dali_queue_depth: int = 2
    dali_outputs_per_tensor: float = 3
    usable_fraction: float = 39.39 / 40
    measured: str = ""

    @classmethod
    def load(cls, path: str | Path | None) -> MemoryTerms:
        """The defaults, with the values a `make gpu-check` file measured (None: defaults)."""
        if path is None:
            return cls()
        try:
            values = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"--memory_terms {path}: cannot read it as JSON ({e}); expected "
                            "the memory_terms.json that make gpu-check writes") from None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UserError(f"--memory_terms {path}: unknown keys {', '.join(unknown)}; "
                            f"expected some of {', '.join(sorted(known))}")
        return replace(cls(), **values)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")


SOURCES = {
    "allocator rounding": "PyTorch's caching allocator (c10/cuda/CUDACachingAllocator.cpp: "
    "kMinBlockSize 512 B, kRoundLarge 2 MiB, a block splits when more than kSmallSize 1 MiB "
    "is left); it gives the tutorial's failed requests exactly: 318, 254 and 508 MiB",
    "cuBLAS workspaces": "PyTorch's aten/src/ATen/cuda/CublasHandlePool.cpp: "
    "CUBLAS_WORKSPACE_CONFIG's default :4096:2:16:8 (8.125 MiB; 32 MiB on Hopper) plus "
    "CUBLASLT_WORKSPACE_SIZE's 1 MiB, from the caching allocator, per handle and stream",
    "fragmentation": "the tutorial's out-of-memory messages: reserved but unallocated 1.40 GiB "
    "of 31.34 allocated (SC23), 0.16 of 31.28 (SC24), 0.33 of 32.00 (SC25): the largest share",
    "CUDA context": "about 400 MB with CUDA >= 11.7 and lazy module loading (pytorch/pytorch"
    "#109888), which PyTorch sets since 1.13 (CUDA_MODULE_LOADING=LAZY, pytorch/pytorch#86509)",
    "kernels and libraries": "the rest of what SC25's mp tp 1 process held outside the "
    "allocator (38.89 GiB in use - 32.33 reserved = 6.56) once the context, NCCL and DALI "
    "terms of the tutorial's code are taken off (planning/published_memory.py)",
    "NCCL buffers": "NCCL_BUFFSIZE 4 MiB (Simple) plus the LL128 and LL buffers: 10 MiB per "
    "channel and connection (NVIDIA/nccl#1685); 4 channels between 4 A100 with 4 NVLinks per "
    "pair (NVIDIA/nccl#713), a ring and a tree connection each; memory grows with channels "
    "and communicators (NVIDIA/nccl#986)",
    "DALI buffers": "DALI keeps each operator's output buffers and only grows them, and "
    "holds prefetch_queue_depth (default 2) batches (DALI's Performance Tuning guide); "
    "data/dali.py's GPU graph: the copy to the GPU, the subtraction and the division (one "
    "ArithmeticGenericOp per operator: nvidia/dali/ops/_operators/math.py)",
    "usable memory": "CUDA's total of an A100 40GB: 39.39 GiB (the tutorial's out-of-memory "
    "messages, SC23 and SC24); other GPUs: the same share of the memory as sold",
}
INSIDE = ("allocator rounding", "cuBLAS workspaces", "fragmentation")
OUTSIDE = ("CUDA context", "kernels and libraries", "NCCL buffers", "DALI buffers")
NAMES = INSIDE + OUTSIDE


def block_bytes(nbytes: int) -> int:
    """The block PyTorch's caching allocator gives a fresh request of `nbytes`: 512 B-rounded,
    or, over 1 MiB, the whole 2 MiB-rounded segment when at most 1 MiB of it is left over."""
    rounded = max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)
    if rounded <= SMALL_SIZE:
        return rounded
    segment = segment_bytes(rounded)
    return segment if segment - rounded <= SMALL_SIZE else rounded


def segment_bytes(nbytes: int) -> int:
    """What the allocator asks cudaMalloc for when no cached block fits `nbytes` (the
    "Tried to allocate" of an out-of-memory message)."""
    rounded = max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


def communicators(sizes: Mapping[str, int], order: str, rank: int) -> list[tuple[int, ...]]:
    """The ranks of every NCCL communicator `rank` is in: the world's (made when the process
    group starts) and its group in each distinct partition comm.init makes (RankGenerator:
    "tp", "tp-cp" and "mp" are one while cp = 1; a partition of one group is the world's)."""
    layout = RankGenerator(sizes, order)
    found = {tuple(range(layout.world_size))} if layout.world_size > 1 else set()
    for _, groups in layout.partitions():
        found.add(tuple(next(g for g in groups if rank in g)))
    return sorted(found, key=lambda g: (len(g), g))


@dataclass(frozen=True)
class Workload:
    """What the outside terms depend on: a DALI batch's bytes (input and target of the local
    batch; 0 without DALI) and the NCCL communicators of this rank."""

    dali_batch_bytes: float
    communicators: Sequence[tuple[int, ...]]

    @classmethod
    def of(cls, data_loader: str, local_batch: int, channels: int, tile: tuple[int, int],
           comms: Sequence[tuple[int, ...]]) -> Workload:
        """`channels`: of the input and the target together (a rollout's every step)."""
        per_batch = local_batch * channels * math.prod(tile) * 4  # float32 fields
        return cls(per_batch if data_loader == "dali" else 0.0, comms)


def dali_gib(batch_bytes: float, terms: MemoryTerms, pipelines: int = 2) -> float:
    """The DALI pipelines' device buffers: training and validation each hold the queue's
    batches in every GPU operator's output (`batch_bytes`: a batch's input and target)."""
    outputs = terms.dali_queue_depth * terms.dali_outputs_per_tensor
    return pipelines * outputs * batch_bytes / GIB


def nccl_gib(count: int, terms: MemoryTerms) -> float:
    """`count` communicators' buffers: measured, or channels x connections x 10 MiB each."""
    each = terms.nccl_communicator_mib or \
        terms.nccl_channels * terms.nccl_connections * NCCL_CONNECTION_MIB
    return count * each * MIB / GIB


def beyond_tensors(tensor_peak: float, rounding: float, work: Workload,
                   terms: MemoryTerms | None = None) -> dict[str, float]:
    """GiB of every term (`NAMES`) for a traced peak of `tensor_peak` bytes whose tensors
    the allocator rounds up by `rounding` bytes."""
    terms = terms or MemoryTerms()
    workspaces = terms.cublas_workspaces * terms.cublas_workspace_mib * MIB
    allocated = tensor_peak + rounding + workspaces
    return {"allocator rounding": rounding / GIB,
            "cuBLAS workspaces": workspaces / GIB,
            "fragmentation": terms.fragmentation * allocated / GIB,
            "CUDA context": terms.context_gib,
            "kernels and libraries": terms.kernels_gib,
            "NCCL buffers": nccl_gib(len(work.communicators), terms),
            "DALI buffers": dali_gib(work.dali_batch_bytes, terms)}


def usable_gib(memory_gb: float, terms: MemoryTerms | None = None) -> float:
    """What CUDA reports as the total of a GPU sold as `memory_gb` (GiB): the rest the driver
    keeps (ECC, page tables)."""
    return memory_gb * (terms or MemoryTerms()).usable_fraction


def driver_reserve_gib(memory_gb: float, terms: MemoryTerms | None = None) -> float:
    """What NVML counts as used on an idle GPU (its `used` is the reserved plus the
    processes' memory: nvmlMemory_t)."""
    return memory_gb - usable_gib(memory_gb, terms)
