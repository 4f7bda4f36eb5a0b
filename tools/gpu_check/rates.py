"""The time model's operator rates on this GPU, measured in seconds: written as a
machine file (machine.json beside the report) that the dry run reads in place of the
published defaults (`python -m bench.dry_run --machine_file <report folder>/machine.json`).

What is measured (planning/rates.py's tables), each the best of REPEATS timed runs after a
warm-up, timed with CUDA events on a GPU:
  GEMM       torch.mm of n x n by n x n for each n of GEMM_SIZES, per dtype (bf16, fp16,
             fp32 as TF32, as training allows it): 2 n^3 FLOPs
  attention  SDPA forward and backward, (batch x 8 heads, seq, head dim) for each seq of
             ATTENTION_SEQ and head dim 64 and 128, per dtype: the FLOPs PyTorch's counter
             gives (torch.utils.flop_counter), forward and backward
  memory     torch.add(a, b, out=c) for each element count of MEMORY_ELEMENTS (fp32): the
             bytes read and written
  launch     a one-element add, 100 times: seconds per kernel
  h2d        a pinned fp32 batch of H2D_BYTES copied to the device (on a CPU: a copy)
  host       a sample of the tutorial's layout (input and target, 20 channels of H x W
             float32) read from an HDF5 file and normalised, as a loader process does
On a CPU (the tests) the same code runs at `small` shapes: the file round-trips, the rates
are a CPU's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from planning.rates import Curve, MachineRates, write_machine_file
from tools.gpu_check.report import Outcome

REPEATS = 5
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GEMM_SIZES = (1024, 2048, 4096, 8192)
ATTENTION_SEQ = (1024, 4096)
ATTENTION_BATCH = 8  # x 8 heads
MEMORY_ELEMENTS = (2**16, 2**20, 2**24, 2**27)
H2D_BYTES = 2**28
SAMPLE_HW = (360, 720)
SMALL = {"gemm": (32, 64, 128), "seq": (16, 32), "batch": 1, "memory": (2**10, 2**14, 2**18),
         "h2d": 2**20, "hw": (18, 36)}
MACHINE_FILE = "machine.json"


def best_seconds(fn: Callable[[], Any], device: torch.device, repeats: int = REPEATS) -> float:
    """The fastest of `repeats` timed calls of `fn`, after one warm-up call."""
    fn()
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
    return best


def gemm_curve(dtype: torch.dtype, sizes: tuple[int, ...], device: torch.device) -> Curve:
    points = []
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        seconds = best_seconds(lambda a=a, b=b: torch.mm(a, b), device)
        points.append((2.0 * n**3, 2.0 * n**3 / seconds))
    return Curve(tuple(points))


def attention_curve(dtype: torch.dtype, head_dim: int, seqs: tuple[int, ...], batch: int,
                    device: torch.device, heads: int = 8) -> Curve:
    """FLOP/s of SDPA's forward and backward at each sequence length, by key length."""
    points = []
    for seq in seqs:
        shape = (batch, heads, seq, head_dim)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(shape, device=device, dtype=dtype)
        flops = sdpa_flop_count(shape, shape, shape) + \
            sdpa_backward_flop_count(shape, shape, shape, shape)

        def step(q=q, k=k, v=v, grad=grad) -> None:
            F.scaled_dot_product_attention(q, k, v).backward(grad)

        points.append((float(seq), flops / best_seconds(step, device)))
    return Curve(tuple(points))


def memory_curve(counts: tuple[int, ...], device: torch.device) -> Curve:
    points = []
    for n in counts:
        a, b, c = (torch.empty(n, device=device) for _ in range(3))
        a.fill_(1.0), b.fill_(2.0)
        seconds = best_seconds(lambda a=a, b=b, c=c: torch.add(a, b, out=c), device)
        points.append((3.0 * 4 * n, 3.0 * 4 * n / seconds))
    return Curve(tuple(points))


def launch_seconds(device: torch.device) -> float:
    x = torch.zeros(1, device=device)

    def hundred() -> None:
        for _ in range(100):
            x.add_(1.0)

    return best_seconds(hundred, device) / 100


def h2d_bytes_per_s(nbytes: int, device: torch.device) -> float:
    pin = device.type == "cuda"
    host = torch.empty(nbytes // 4, pin_memory=pin)
    target = torch.empty(nbytes // 4, device=device)
    return nbytes / best_seconds(lambda: target.copy_(host, non_blocking=True), device)


def host_bytes_per_s(work: Path, hw: tuple[int, int]) -> float:
    """A loader process's rate: a sample pair read from HDF5 and normalised (data/dataset.py
    does the same: subtract the means, divide by the standard deviations, in place)."""
    path = work / "rates_sample.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("fields", data=np.random.rand(2, 20, *hw).astype(np.float32),
                         chunks=(1, 20, *hw))
    means, stds = np.float32(0.5), np.float32(0.3)
    best = math.inf
    with h5py.File(path, "r") as f:
        fields = f["fields"]
        for _ in range(REPEATS + 1):
            start = time.perf_counter()
            for x in (fields[0], fields[1]):
                x -= means
                x /= stds
            best = min(best, time.perf_counter() - start)
    path.unlink()
    return 2 * 20 * hw[0] * hw[1] * 4 / best


def measure(device: torch.device, work: Path, small: bool = False) -> MachineRates:
    """Every rate of the module docstring on `device` (`small` shapes: the tests)."""
    gemm_sizes = SMALL["gemm"] if small else GEMM_SIZES
    seqs = SMALL["seq"] if small else ATTENTION_SEQ
    batch = SMALL["batch"] if small else ATTENTION_BATCH
    counts = SMALL["memory"] if small else MEMORY_ELEMENTS
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # as training runs fp32 matmuls
    try:
        gemm = {d: gemm_curve(t, gemm_sizes, device) for d, t in DTYPES.items()}
        attention = {d: {h: attention_curve(t, h, seqs, batch, device, 1 if small else 8)
                         for h in (64, 128)} for d, t in DTYPES.items()}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return MachineRates(
        name, gemm, attention, memory_curve(counts, device), launch_seconds(device),
        h2d_bytes_per_s(SMALL["h2d"] if small else H2D_BYTES, device),
        host_bytes_per_s(work, SMALL["hw"] if small else SAMPLE_HW),
        source=f"measured by make gpu-check on {name}, torch {torch.__version__}")


def measure_and_write(device: torch.device, out: Path, work: Path,
                      small: bool = False) -> Outcome:
    """The gpu-check's line: measure, write `out`/machine.json, say the headline rates."""
    rates = measure(device, work, small)
    path = out / MACHINE_FILE
    write_machine_file(path, rates)
    top = rates.gemm_curves["bf16"].points[-1][1]
    attention = rates.attention_curves["bf16"][128].points[-1][1]
    memory = rates.memory_curve.points[-1][1]
    return Outcome(True, f"bf16 GEMM {top / 1e12:.3g} TFLOP/s, attention {attention / 1e12:.3g}, "
                   f"HBM {memory / 1e9:.4g} GB/s",
                   f"machine file {path}: python -m bench.dry_run --machine_file {path}",
                   {"machine_file": str(path), **rates.to_json()})
