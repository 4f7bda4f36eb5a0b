"""Memory: the planner (planning/memory.py, planning/memory_terms.py) against what the
device allocates, reserves and uses, for a config at tp 1 and the largest local batch the
device holds, and every term beyond the tensors measured on this GPU (`measure_terms`).

On a GPU, per config (`short`, `mp`):
  - the local batch: the largest whose planned peak (tensors and every term) fits the device,
    from the planner's traces at batch 1 and 2 (every phase is affine in the batch), capped
    at MAX_BATCH;
  - the run: the model, Adam and loss train.py builds, in the config's precision, eagerly
    (the planner traces the eager step); one step warms up (Adam's state, cuDNN's
    autotuning, the allocator's first blocks), then the peaks are reset and step 2 is
    measured: `torch.cuda.max_memory_allocated` (tensors and cuBLAS's workspaces),
    `max_memory_reserved` (the caching allocator's segments) and the memory in use on the
    device after it (CUDA's total less free: this process's context, kernels and libraries
    included), each beside the planner's figure of the same quantity;
  - out of memory at that batch: a FAIL, the planner's figures beside the peaks at the
    failure (`out_of_memory`): the planner underestimated, which is what this is for.
The terms, in fresh processes (`python -m tools.gpu_check.memory probe|nccl`), so that
nothing this process loaded counts: the CUDA context (in use after the first tensor), the
cuBLAS workspaces (what stays allocated after matmuls forward and backward), the kernels and
libraries (in use after two steps of `mp` at depth 2, less the allocator's and the
context's), NCCL's buffers for one communicator (two processes on two GPUs, where there are
two), DALI's buffers for one pipeline (where DALI and the ladder's data set are there); the
allocator's slack (reserved - allocated) from the runs above. They go into
`<work>/memory_terms.json`, which `python -m bench.memory_plan --memory_terms` reads.
On a CPU (the tests), the measurement is of the tensors alone: the profiler's allocation
events over set-up and two steps (bench/bench_memory.py's `allocation_peaks`).
"""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from planning import memory as planner
from planning.memory import GIB
from planning.memory_terms import MIB, MemoryTerms, Workload, beyond_tensors
from tools.gpu_check import harness
from tools.gpu_check.report import Line, Outcome, Skip, free_gpu_memory
from utils import devices
from utils.config import read_config

MAX_BATCH = 64      # the largest local batch tried: time, not memory, bounds it beyond
FILL = 0.90         # of the device's memory the planned peak may take
TARGET = 0.10       # the planner's reserved peak within 10 % of the measured one
ONE_PROCESS = Workload(0.0, ())  # batches in memory, a one-rank group: no DALI, no NCCL


def config_at(name: str, expdir: str, **keys: Any) -> Any:
    """The repository's config `name` at tp 1, eager (the planner's step), with `keys`."""
    cfg = read_config(str(harness.CONFIG_FILE), name, environ={})
    return cfg.replace(tp=1, cp=1, enable_jit=False, fsdp=False, expdir=expdir, **keys)


def planned(cfg: Any, device: torch.device, batch: int) -> planner.Estimate:
    layout = harness.layout_of(cfg, device)
    return planner.trace_layout(cfg, layout, batch, device.type)


def planned_gib(estimate: planner.Estimate) -> dict[str, float]:
    """The planner's allocated, reserved and in-use peaks (GiB) of a one-process run."""
    terms = beyond_tensors(estimate.peak, estimate.rounding, ONE_PROCESS)
    allocated = estimate.peak / GIB + terms["allocator rounding"] + terms["cuBLAS workspaces"]
    reserved = allocated + terms["fragmentation"]
    return {"allocated": allocated, "reserved": reserved,
            "in_use": reserved + terms["CUDA context"] + terms["kernels and libraries"]}


def largest_batch(cfg: Any, device: torch.device, memory_gib: float) -> tuple[int, float]:
    """(the largest local batch whose planned peak with every term fits `memory_gib` x
    FILL, at most MAX_BATCH; its planned tensors' peak in GiB)."""
    one, two = (planned(cfg, device, b) for b in (1, 2))
    per_sample = max((two.peak - one.peak) / GIB, 1e-6)
    beyond = planned_gib(one)["in_use"] - one.peak / GIB  # the terms at batch 1
    batch = 1
    for b in range(MAX_BATCH, 0, -1):
        tensors = one.peak / GIB + (b - 1) * per_sample
        if tensors * (1 + MemoryTerms().fragmentation) + beyond <= memory_gib * FILL:
            batch = b
            break
    return batch, one.peak / GIB + (batch - 1) * per_sample


def device_used_gib(device: torch.device) -> float:
    """Memory in use on the device (CUDA's total less its free: every process's, this one's
    context and libraries included; the driver's own reserve is not in CUDA's total)."""
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / GIB


def measure_gpu(cfg: Any, device: torch.device, batch: int) -> dict[str, float]:
    """Step 2's peaks after a reset once warm (module docstring), GiB."""
    torch.cuda.reset_peak_memory_stats(device)  # an out-of-memory's peak is this config's
    run = harness.build(cfg.replace(local_batch_size=batch), device)
    shape = (batch, cfg.n_in_channels, *cfg.img_size)
    x, y = torch.randn(shape, device=device), torch.randn(shape, device=device)
    step = harness.Step()
    step(run, x, y)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step(run, x, y)
    torch.cuda.synchronize(device)
    out = {"allocated": torch.cuda.max_memory_allocated(device) / GIB,
           "reserved": torch.cuda.max_memory_reserved(device) / GIB,
           "in_use": device_used_gib(device)}
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
        return out_of_memory(name, device, batch, estimate, total, failed)
    data = {"config": name, "local_batch": batch, "amp_mode": cfg.amp_mode,
            "planned_tensors_gib": tensors, **measured}
    data["tensors_error"] = tensors / measured["allocated"] - 1
    number = (f"batch {batch}: planned tensors {tensors:.3g} GiB, allocated "
              f"{measured['allocated']:.3g} ({data['tensors_error']:+.0%})")
    if device.type != "cuda":
        return Outcome(abs(data["tensors_error"]) <= 0.15, number + " (CPU: tensors only)",
                       data=data)
    plan = planned_gib(estimate)
    data.update({f"planned_{k}_gib": v for k, v in plan.items()},
                **{f"{k}_error": plan[k] / measured[k] - 1 for k in plan},
                slack_fraction=measured["reserved"] / measured["allocated"] - 1)
    ok = abs(data["reserved_error"]) <= TARGET
    number = f"batch {batch}, GiB measured / planned: " + ", ".join(
        f"{k.replace('_', ' ')} {measured[k]:.2f} / {plan[k]:.2f} ({data[k + '_error']:+.0%})"
        for k in plan)
    return Outcome(ok, number, "" if ok else f"planner more than {TARGET:.0%} from the "
                   "reserved peak: paste the report into an issue", data)


def out_of_memory(name: str, device: torch.device, batch: int, estimate: planner.Estimate,
                  total: float, error: str) -> Outcome:
    """The planner's batch ran out of memory: the planner said its peak fits FILL of the
    GPU, so it underestimated, which this section exists to find. A FAIL with the planned
    figures and those measured at the failure (the peaks since the run began, and the
    allocation that failed, from PyTorch's `error` message)."""
    at_failure = {"allocated": torch.cuda.max_memory_allocated(device) / GIB,
                  "reserved": torch.cuda.max_memory_reserved(device) / GIB}
    free_gpu_memory()
    tried = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", error)
    plan = planned_gib(estimate)
    data = {"config": name, "local_batch": batch, "out_of_memory": True,
            "planned_tensors_gib": estimate.peak / GIB,
            **{f"planned_{k}_gib": v for k, v in plan.items()},
            "gpu_gib": total, "allocated_at_failure": at_failure["allocated"],
            "reserved_at_failure": at_failure["reserved"],
            "tried_to_allocate": tried.group(1) if tried else None}
    number = (f"batch {batch} ran out of memory: planned allocated {plan['allocated']:.3g}, "
              f"reserved {plan['reserved']:.3g}, in use {plan['in_use']:.3g} GiB (within "
              f"{FILL:.0%} of the GPU's {total:.3g}); at the failure allocated "
              f"{at_failure['allocated']:.3g}, reserved {at_failure['reserved']:.3g} GiB"
              + (f", tried to allocate {data['tried_to_allocate']}" if tried else ""))
    return Outcome(False, number, "the planner underestimated: its batch does not fit; "
                   "paste the report into an issue", data)


def _child(*args: str) -> dict[str, Any]:
    """`python -m tools.gpu_check.memory <args>` in a fresh process: its JSON line."""
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_check.memory", *args],
                          cwd=harness.REPO, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"memory {args[0]}: {(proc.stderr or proc.stdout).strip()[-300:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_terms(device: torch.device, work: str) -> Line:
    """Every term beyond the tensors measured here (module docstring), saved where
    `bench.memory_plan --memory_terms` reads it."""
    if device.type != "cuda":
        raise Skip("the terms beyond the tensors need a GPU")
    gc.collect()
    torch.cuda.empty_cache()
    baseline = device_used_gib(device)  # this process, while the probe runs alone
    got = _child("probe", "--index", str(device.index or 0), "--baseline_gib", str(baseline),
                 "--work", work)
    notes = [got.pop("note")] if "note" in got else []
    if torch.cuda.device_count() >= 2:
        try:
            got["nccl_communicator_mib"] = _nccl_pair()
        except Exception as e:  # noqa: BLE001 - the other terms stand without NCCL's
            notes.append(f"NCCL not measured ({type(e).__name__}: {str(e)[:120]})")
    else:
        notes.append("NCCL not measured: one GPU")
    terms = replace(MemoryTerms(), **got, measured=f"{torch.cuda.get_device_name(device)}, "
                    "make gpu-check")
    path = Path(work) / "memory_terms.json"
    terms.save(path)
    number = ", ".join(f"{k} {v:.3g}" for k, v in got.items())
    return Line("memory", "terms beyond the tensors", "info", number,
                "; ".join([*notes, f"saved {path}: bench.memory_plan --memory_terms {path}"]),
                data={"measured": got, "path": str(path)})


def _nccl_pair() -> float:
    """MiB one communicator of two GPUs holds (the larger of its two ranks')."""
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        procs = [subprocess.Popen([sys.executable, "-m", "tools.gpu_check.memory", "nccl",
                                   "--rank", str(r), "--store", str(store)],
                                  cwd=harness.REPO, stdout=subprocess.PIPE, text=True)
                 for r in (0, 1)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a rank of the two-GPU communicator failed")
    return max(json.loads(o.strip().splitlines()[-1])["nccl_communicator_mib"] for o in outs)


def calibration(lines: list[Line]) -> list[str]:
    """Markdown: each term as measured here beside the planner's default."""
    defaults = MemoryTerms()
    terms = next((line.data for line in lines if line.section == "memory"
                  and line.name == "terms beyond the tensors" and line.data), None)
    slack = [line.data["slack_fraction"] for line in lines if line.section == "memory"
             and "slack_fraction" in line.data]
    out = ["The planner's terms beyond the tensors: `planning/memory_terms.py` (each default "
           "with its source; `python -m bench.memory_plan --published` sets them beside the "
           "tutorial's runs)."]
    if terms is None:
        return [*out, "Not measured here: it needs a GPU."]
    measured = terms["measured"]
    out += ["", "| term | planner's default | measured here |", "| --- | ---: | ---: |"]
    out += [f"| {k} | {getattr(defaults, k)} | {v:.4g} |" for k, v in measured.items()]
    if slack:  # not saved: without memory pressure the cache keeps blocks it would free
        out.append(f"| reserved / allocated - 1 at step 2 (fragmentation's upper bound) "
                   f"| {defaults.fragmentation} | {max(slack):.4g} |")
    line = json.dumps({k: round(v, 4) for k, v in measured.items()})
    out += ["", f"Saved as `{terms['path']}`: plan with `python -m bench.memory_plan "
            f"--memory_terms {terms['path']}`, or paste `{line}` into a file of your own."]
    return out


def _probe(index: int, baseline: float, work: str) -> dict[str, Any]:
    """In a fresh process: the context, cuBLAS's workspaces, the step's kernels and, where
    DALI and the ladder's data set are there, one DALI pipeline (GiB, MiB as named)."""
    device = devices.gpu(index)
    torch.cuda.set_device(device)
    torch.empty(1, device=device)
    torch.cuda.synchronize()
    context = device_used_gib(device) - baseline - torch.cuda.memory_reserved() / GIB
    a = torch.randn(1024, 1024, device=device, dtype=torch.float16, requires_grad=True)
    bias = torch.zeros(1024, device=device, dtype=torch.float16, requires_grad=True)
    torch.nn.functional.linear(a @ a, a, bias).sum().backward()  # backward: autograd's thread
    del a, bias
    gc.collect()
    torch.cuda.synchronize()
    workspaces = torch.cuda.memory_allocated() / MIB
    harness.join(device)
    cfg = config_at("mp", work, depth=2)
    run = harness.build(cfg.replace(local_batch_size=1), device)
    x = torch.randn(1, cfg.n_in_channels, *cfg.img_size, device=device)
    for _ in range(2):
        harness.Step()(run, x, x)
    torch.cuda.synchronize()
    outside = device_used_gib(device) - baseline - torch.cuda.memory_reserved() / GIB
    got = {"context_gib": context, "kernels_gib": outside - context,
           "cublas_workspace_mib": workspaces, "cublas_workspaces": 1}
    try:
        return {**got, **_dali(cfg, work, device)}
    except Exception as e:  # noqa: BLE001 - DALI is optional: the other terms stand
        return {**got, "note": f"DALI not measured ({type(e).__name__}: {str(e)[:120]})"}


def _dali(cfg: Any, work: str, device: torch.device) -> dict[str, Any]:
    """One DALI pipeline's buffers as outputs per tensor (planning/memory_terms.py)."""
    from tools.gpu_check.ladder import paths

    data = Path(work) / f"data_{cfg.img_size[0]}x{cfg.img_size[1]}"
    try:
        import nvidia.dali  # noqa: F401 - optional

        from data.dali import get_data_loader_dali
    except ImportError:
        return {"note": "DALI not measured: nvidia.dali is not installed"}
    if not (data / "stats" / "time_means.npy").exists():
        return {"note": "DALI not measured: the ladder's data set is not there yet"}
    batch = 4
    before = device_used_gib(device) - torch.cuda.memory_reserved() / GIB
    cfg = cfg.replace(data_loader_config="dali", num_data_workers=2, **paths(data))
    loader, _, _ = get_data_loader_dali(cfg, cfg.train_data_path, True, batch_size=batch)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    torch.cuda.synchronize()
    after = device_used_gib(device) - torch.cuda.memory_reserved() / GIB
    loader.close()
    batch_bytes = batch * (cfg.n_in_channels + cfg.n_out_channels) * 4 * \
        cfg.img_size[0] * cfg.img_size[1]
    depth = MemoryTerms().dali_queue_depth
    return {"dali_outputs_per_tensor": (after - before) * GIB / (depth * batch_bytes)}


def _nccl(rank: int, store: str) -> dict[str, float]:
    """One rank of a two-GPU communicator: what its set-up and a 64 MiB all-reduce (which
    connects the ring and the tree) leave in use outside the allocator (MiB)."""
    import torch.distributed as dist

    device = devices.gpu(rank)
    torch.cuda.set_device(device)
    torch.empty(1, device=device)
    before = device_used_gib(device) - torch.cuda.memory_reserved() / GIB
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2,
                            device_id=device)
    dist.all_reduce(torch.ones(16 * MIB, device=device))
    torch.cuda.synchronize()
    after = device_used_gib(device) - torch.cuda.memory_reserved() / GIB
    dist.destroy_process_group()
    return {"nccl_communicator_mib": (after - before) * GIB / MIB}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="a memory term, in a fresh process")
    parser.add_argument("what", choices=["probe", "nccl"])
    parser.add_argument("--baseline_gib", type=float, default=0.0)
    parser.add_argument("--work", default=tempfile.gettempdir())
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--store", default="")
    args = parser.parse_args()
    result = _probe(args.index, args.baseline_gib, args.work) if args.what == "probe" else \
        _nccl(args.rank, args.store)
    print(json.dumps(result))
