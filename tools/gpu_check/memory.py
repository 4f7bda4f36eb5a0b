"""Memory: the planner (planning/memory.py) against what the device allocates, reserves
and uses, for a config at tp 1 and the largest local batch the device holds, and the
measured parts of the planner's allowance for what no tensor shows.

On a GPU, per config (`short`, `mp`):
  - the local batch: the largest whose planned peak (tensors + allowance) fits the device,
    from the planner's traces at batch 1 and 2 (every phase is affine in the batch), capped
    at MAX_BATCH;
  - the run: the model, Adam and loss train.py builds, in the config's precision, eagerly
    (the planner traces the eager step); one step warms up (Adam's state, cuDNN's
    autotuning, the allocator's first blocks), then the peaks are reset and step 2 is
    measured: `torch.cuda.max_memory_allocated` (tensors), `max_memory_reserved` (the
    caching allocator's blocks) and the device's used memory after it (NVML's, through
    pynvml where installed, else `torch.cuda.mem_get_info`: everything on the device,
    the CUDA context, NCCL's buffers and the libraries' workspaces included);
  - the parts: allocator slack = reserved - allocated (FRAGMENTATION is its share of the
    tensors), outside the allocator = device used - reserved (CONTEXT_GIB), each set from
    what this measures (`calibration`).
  - out of memory at that batch: a FAIL, the planner's figures beside the peaks at the
    failure (`out_of_memory`): the planner underestimated, which is what this is for.
On a CPU (the tests), the measurement is of the tensors alone: the profiler's allocation
events over set-up and two steps (bench/bench_memory.py's `allocation_peaks`).
"""

from __future__ import annotations

import gc
import math
import re
from typing import Any

import torch

from planning import memory as planner
from planning.memory import GIB
from tools.gpu_check import harness
from tools.gpu_check.report import Line, Outcome, free_gpu_memory
from utils.config import read_config

MAX_BATCH = 64      # the largest local batch tried: time, not memory, bounds it beyond
FILL = 0.90         # of the device's memory the planned peak may take
TARGET = 0.10       # the planner's peak within 10 % of the reserved peak (the aim)


def config_at(name: str, expdir: str, **keys: Any) -> Any:
    """The repository's config `name` at tp 1, eager (the planner's step), with `keys`."""
    cfg = read_config(str(harness.CONFIG_FILE), name, environ={})
    return cfg.replace(tp=1, cp=1, enable_jit=False, fsdp=False, expdir=expdir, **keys)


def planned(cfg: Any, device: torch.device, batch: int) -> planner.Estimate:
    layout = harness.layout_of(cfg, device)
    return planner.trace_layout(cfg, layout, batch, device.type)


def largest_batch(cfg: Any, device: torch.device, memory_gib: float) -> tuple[int, float]:
    """(the largest local batch whose planned peak with the allowance fits `memory_gib` x
    FILL, at most MAX_BATCH; its planned tensors' peak in GiB)."""
    one, two = (planned(cfg, device, b).peak / GIB for b in (1, 2))
    per_sample = max(two - one, 1e-6)
    room = memory_gib * FILL
    batch = 1
    for b in range(MAX_BATCH, 0, -1):
        tensors = one + (b - 1) * per_sample
        if tensors + planner.allowance_gib(tensors) <= room:
            batch = b
            break
    return batch, one + (batch - 1) * per_sample


def device_used_gib(device: torch.device) -> tuple[float, str]:
    """Memory in use on the whole device: NVML's where pynvml is there, else CUDA's."""
    try:
        import pynvml

        pynvml.nvmlInit()
        props = torch.cuda.get_device_properties(device)
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(
                f"{props.pci_domain_id:08x}:{bus:02x}:{props.pci_device_id:02x}.0")
            return pynvml.nvmlDeviceGetMemoryInfo(handle).used / GIB, "NVML"
    except Exception:  # noqa: BLE001 - NVML is optional: CUDA's count next
        pass
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / GIB, "cudaMemGetInfo"


def measure_gpu(cfg: Any, device: torch.device, batch: int) -> dict[str, float]:
    """Step 2's peaks after a reset once warm (module docstring), GiB."""
    torch.cuda.reset_peak_memory_stats(device)  # an out-of-memory's peak is this config's
    run = harness.build(cfg.replace(local_batch_size=batch), device)
    shape = (batch, cfg.n_in_channels, *cfg.img_size)
    x, y = torch.randn(shape, device=device), torch.randn(shape, device=device)
    step = harness.Step()
    used_before, _ = device_used_gib(device)
    step(run, x, y)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step(run, x, y)
    torch.cuda.synchronize(device)
    used, source = device_used_gib(device)
    out = {"allocated": torch.cuda.max_memory_allocated(device) / GIB,
           "reserved": torch.cuda.max_memory_reserved(device) / GIB,
           "reserved_now": torch.cuda.memory_reserved(device) / GIB,
           "used": used, "used_before_first_step": used_before, "used_source": source}
    del run, x, y
    gc.collect()
    torch.cuda.empty_cache()
    return out


def measure_cpu(cfg: Any, device: torch.device, batch: int) -> dict[str, float]:
    """The tensors' peak over set-up and two steps, from the profiler's allocations."""
    from torch.profiler import ProfilerActivity, profile

    from bench.bench_memory import allocation_peaks

    shape = (batch, cfg.n_in_channels, *cfg.img_size)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run = harness.build(cfg.replace(local_batch_size=batch), device)
        x, y = torch.randn(shape), torch.randn(shape)
        step = harness.Step()
        step(run, x, y)
        step(run, x, y)
    peak, _ = allocation_peaks(prof)
    return {"allocated": peak / GIB}


def planner_against_device(name: str, device: torch.device, work: str,
                           **keys: Any) -> Outcome:
    """One config: the planner's estimate beside the measured peaks (module docstring).
    On a GPU, running out of memory at the planner's own batch is a FAIL (`out_of_memory`)."""
    cfg = config_at(name, work, **keys)
    total = 0.0  # GiB of the GPU
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / GIB
        batch, _ = largest_batch(cfg, device, total)
    else:
        batch = cfg.local_batch_size or cfg.global_batch_size
    estimate = planned(cfg, device, batch)
    tensors = estimate.peak / GIB
    try:
        measured = (measure_gpu if device.type == "cuda" else measure_cpu)(cfg, device, batch)
    except torch.cuda.OutOfMemoryError as e:
        failed = str(e)  # not the error: its traceback holds the run's tensors
    else:
        failed = None
    if failed is not None:
        return out_of_memory(name, device, batch, tensors, total, failed)
    data = {"config": name, "local_batch": batch, "amp_mode": cfg.amp_mode,
            "planned_tensors_gib": tensors, **measured}
    data["tensors_error"] = tensors / measured["allocated"] - 1
    number = (f"batch {batch}: planned tensors {tensors:.3g} GiB, allocated "
              f"{measured['allocated']:.3g} ({data['tensors_error']:+.0%})")
    if device.type != "cuda":
        return Outcome(abs(data["tensors_error"]) <= 0.15, number + " (CPU: tensors only)",
                       data=data)
    with_slack = tensors * (1 + planner.FRAGMENTATION)
    data.update(planned_with_slack_gib=with_slack,
                reserved_error=with_slack / measured["reserved"] - 1,
                slack_gib=measured["reserved"] - measured["allocated"],
                slack_fraction=measured["reserved"] / measured["allocated"] - 1,
                outside_allocator_gib=measured["used"] - measured["reserved_now"],
                planned_peak_gib=tensors + planner.allowance_gib(tensors))
    ok = abs(data["reserved_error"]) <= TARGET
    number += (f"; reserved {measured['reserved']:.2f} vs planned {with_slack:.2f} "
               f"({data['reserved_error']:+.0%}); used {measured['used']:.2f} vs planned "
               f"{data['planned_peak_gib']:.2f}")
    return Outcome(ok, number, "" if ok else f"planner more than {TARGET:.0%} from the "
                   "reserved peak: paste the report into an issue", data)


def out_of_memory(name: str, device: torch.device, batch: int, tensors: float,
                  total: float, error: str) -> Outcome:
    """The planner's batch ran out of memory: the planner said its peak fits FILL of the
    GPU, so it underestimated, which this section exists to find. A FAIL with the planned
    figures and those measured at the failure (the peaks since the run began, and the
    allocation that failed, from PyTorch's `error` message)."""
    at_failure = {"allocated": torch.cuda.max_memory_allocated(device) / GIB,
                  "reserved": torch.cuda.max_memory_reserved(device) / GIB}
    free_gpu_memory()
    tried = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", error)
    planned_peak = tensors + planner.allowance_gib(tensors)
    data = {"config": name, "local_batch": batch, "out_of_memory": True,
            "planned_tensors_gib": tensors, "planned_peak_gib": planned_peak,
            "gpu_gib": total, "allocated_at_failure": at_failure["allocated"],
            "reserved_at_failure": at_failure["reserved"],
            "tried_to_allocate": tried.group(1) if tried else None}
    number = (f"batch {batch} ran out of memory: planned tensors {tensors:.3g} GiB, peak "
              f"{planned_peak:.3g} (within {FILL:.0%} of the GPU's {total:.3g}); at the "
              f"failure allocated {at_failure['allocated']:.3g}, reserved "
              f"{at_failure['reserved']:.3g} GiB"
              + (f", tried to allocate {data['tried_to_allocate']}" if tried else ""))
    return Outcome(False, number, "the planner underestimated: its batch does not fit; "
                   "paste the report into an issue", data)


def calibration(lines: list[Line]) -> list[str]:
    """Markdown: the allowance's parts as measured here against the planner's values."""
    rows = [line.data for line in lines if line.section == "memory" and "slack_fraction"
            in line.data]
    out = [f"The planner's allowance today: CONTEXT_GIB = {planner.CONTEXT_GIB} GiB and "
           f"FRAGMENTATION = {planner.FRAGMENTATION:.0%} of the tensors "
           f"(`planning/memory.py`; {planner.ALLOWANCE_SOURCE})."]
    if not rows:
        return [*out, "Not measured here: it needs a GPU."]
    out += ["", "| config | batch | allocated | reserved | slack (reserved - allocated) "
            "| device used | outside the allocator (used - reserved) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r['config']} | {r['local_batch']} | {r['allocated']:.2f} "
                   f"| {r['reserved']:.2f} | {r['slack_gib']:.2f} "
                   f"({r['slack_fraction']:.1%}) | {r['used']:.2f} ({r['used_source']}) "
                   f"| {r['outside_allocator_gib']:.2f} |")
    context = max(r["outside_allocator_gib"] for r in rows)
    slack = max(r["slack_fraction"] for r in rows)
    out += ["", f"Measured here (GiB, step 2 after a reset once warm): set CONTEXT_GIB = "
            f"{math.ceil(context * 10) / 10:.1f} and FRAGMENTATION = "
            f"{math.ceil(slack * 100) / 100:.2f} from this GPU (the largest of the configs)."]
    return out


