"""The tutorial's published memory figures for `mp` on Perlmutter's A100s, and the planner's
figures for the same runs, like with like (`python -m bench.memory_plan --published`).

    for check in compare(rows): check.published, check.model, check.error

The published figures are not of this repository's code but of the tutorial's own
(NERSC/sc23-, sc24-, sc25-dl-tutorial, README "Model parallelism"), which holds what ours
does but for three differences, each taken from its source and added to the planner's row
(`tutorial_code`):
  - its DALI pipeline normalises with one `fn.normalize` (two GPU outputs per tensor, the copy
    and the result; data/dali.py has three: the copy, the subtraction, the division);
  - its validation loader, a `DALIGenericIterator` built with `prepare_first_batch`, keeps one
    batch of input and target as PyTorch tensors for the whole run;
  - with tp > 1 its `DistributedMatmul` adds the bias after `F.linear`, in fp32 (the bias is an
    fp32 parameter, the matmul's fp16 output is promoted): the GELU then keeps an fp32 input,
    depth x batch x tokens x 4 embed / tp elements of 4 bytes instead of 2.
Which quantity each figure is: an out-of-memory message gives PyTorch's allocated and reserved
bytes and the process's own use (NVML's per-process figure) when a request failed, so the
run needed at least those plus the request: compared with the planner's peaks of the same
quantities. "Memory usage after forward pass" is NVML's `used` of the whole device at the
second step (its reserved memory included): compared with the planner's peak plus what the
driver keeps (planning/memory_terms.py `driver_reserve_gib`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from planning.memory_terms import GIB, MemoryTerms, dali_gib, driver_reserve_gib, usable_gib

TOKENS = (360 // 8) * (720 // 8)  # mp: 360 x 720 at patch 8
EMBED, DEPTH, CHANNELS, PIXELS = 1024, 12, 20, 360 * 720
MIB = 1024**2

README = "github.com/NERSC/sc{}-dl-tutorial README.md, Model parallelism"


@dataclass(frozen=True)
class Published:
    """One published figure of config `mp` (local batch 16) on `gpus` A100s of
    `gpu_memory_gb`: `kind` 'oom' (the out-of-memory message: `requested_mib`,
    `in_use_gib` of the process, `allocated_gib`, `unallocated_gib` reserved but free) or
    'used' (NVML's used memory of the device after the forward pass of the second step:
    `in_use_gib`; `later_gib` the same line in later epochs)."""

    edition: str
    date: str
    tp: int
    gpus: int
    gpu_memory_gb: float
    kind: str
    in_use_gib: float
    requested_mib: float = 0.0
    allocated_gib: float = 0.0
    unallocated_gib: float = 0.0
    later_gib: float = 0.0

    @property
    def source(self) -> str:
        return README.format(self.edition[2:])


PUBLISHED = (
    Published("SC23", "2023-11-03", 1, 4, 40, "oom", 39.25, 318.0, 31.34, 1.40),
    Published("SC24", "2024-11", 1, 4, 40, "oom", 39.16, 254.0, 31.28, 155.23 / 1024),
    Published("SC25", "2025-11", 1, 4, 40, "oom", 38.89, 508.0, 32.00, 333.01 / 1024),
    Published("SC23", "2023-11-03", 1, 4, 80, "used", 40.08, later_gib=41.20),
    Published("SC24", "2024-11-12", 1, 4, 80, "used", 43.81, later_gib=44.93),
    Published("SC23", "2023-11-04", 4, 16, 40, "used", 28.62, later_gib=32.74),
    Published("SC24", "2024-11-08", 4, 16, 40, "used", 31.68, later_gib=33.24),
    Published("SC25", "2025-11-11", 4, 16, 40, "used", 28.64, later_gib=29.27),
)
# SC25's README says "around 45GB" on an 80 GB GPU without a log: not a figure to compare.
CALIBRATION = PUBLISHED[2]  # SC25's out of memory: the `kernels and libraries` default


def outside_allocator(oom: Published) -> float:
    """GiB an out-of-memory message shows outside PyTorch's allocator: in use by the
    process less what PyTorch reserved (allocated and reserved but unallocated)."""
    return oom.in_use_gib - oom.allocated_gib - oom.unallocated_gib


def calibrated(oom: Published, row: dict[str, Any], terms: MemoryTerms | None = None
               ) -> MemoryTerms:
    """`terms` with `kernels_gib` set so that the tutorial's code in `row`'s layout (its
    tp 1 run) holds outside the allocator what `oom` shows: how each edition's software
    (its container's CUDA, NCCL and DALI) is told apart from the others."""
    terms = terms or MemoryTerms()
    others = tutorial_code(row, terms)["outside"] - terms.kernels_gib
    return replace(terms, kernels_gib=outside_allocator(oom) - others,
                   measured=f"{oom.edition}'s out-of-memory message")


def tutorial_code(row: dict[str, Any], terms: MemoryTerms | None = None) -> dict[str, float]:
    """The planner's row of this code's `mp` run as the tutorial's code runs it (module
    docstring): GiB allocated, reserved and in use by the process at the peak."""
    terms = terms or MemoryTerms()
    batch, tp = row["local_batch"], row["tp"]
    batch_bytes = batch * 2 * CHANNELS * PIXELS * 4  # input and target, float32
    validation_batch = batch_bytes / GIB
    gelu_fp32 = DEPTH * batch * TOKENS * 4 * EMBED // tp * 2 / GIB if tp > 1 else 0.0
    allocated = row["allocated_gb"] + validation_batch + gelu_fp32
    reserved = allocated * (1 + terms.fragmentation)
    ours = row["terms_gb"]["DALI buffers"]
    dali = dali_gib(batch_bytes, MemoryTerms(dali_outputs_per_tensor=2)) if ours else 0.0
    outside = terms.context_gib + terms.kernels_gib + row["terms_gb"]["NCCL buffers"] + dali
    return {"allocated": allocated, "reserved": reserved, "in_use": reserved + outside,
            "outside": outside}


@dataclass(frozen=True)
class Check:
    """One published figure beside the planner's figure of the same quantity (GiB)."""

    figure: Published
    what: str
    published: float
    model: float

    @property
    def error(self) -> float:
        return self.model / self.published - 1


def checks(published: Published, row: dict[str, Any], terms: MemoryTerms | None = None
           ) -> list[Check]:
    """The figures `published` gives, each against the planner's (`row`: this code's `mp`
    in the same layout, as planning/layouts.py makes it)."""
    model = tutorial_code(row, terms)
    if published.kind == "oom":
        request = published.requested_mib * MIB / GIB
        return [Check(published, "allocated by PyTorch, the failed request included",
                      published.allocated_gib + request, model["allocated"]),
                Check(published, "in use by the process, the failed request included",
                      published.in_use_gib + request, model["in_use"])]
    device = driver_reserve_gib(published.gpu_memory_gb, terms) + model["in_use"]
    return [Check(published, "NVML's used memory of the device, step 2", published.in_use_gib,
                  device)]


def verdicts(rows: Sequence[dict[str, Any]], terms: MemoryTerms | None = None
             ) -> list[tuple[Published, bool, bool]]:
    """(figure, whether this code's run fits, whether the tutorial's code's run fits) on
    the figure's GPU, for each published figure whose layout is in `rows`."""
    out = []
    for published in PUBLISHED:
        row = next((r for r in rows if r["tp"] == published.tp), None)
        if row is None:
            continue
        usable = usable_gib(published.gpu_memory_gb, terms)
        out.append((published, row["peak_gb"] <= usable,
                    tutorial_code(row, terms)["in_use"] <= usable))
    return out
