"""What each kind of operator achieves on a GPU, by its shape and dtype: the time model's rates.

    rates = default_rates(gpu)                      # published figures (below)
    rates = read_machine_file("machine.json")       # what `make gpu-check` measured
    rates.gemm("bf16", flops)                       # FLOP/s of one GEMM of `flops`
    rates.attention("bf16", head_dim=48, seq=4050)  # FLOP/s of flash attention
    rates.memory(nbytes)                            # bytes/s of an elementwise operator

Each table is a curve of (size, rate) points, interpolated linearly in log(size) and flat
beyond its ends; the size is a GEMM's FLOPs, an attention's key length, an elementwise
operator's bytes. Attention runs at the kernel's head dim, rounded up to a multiple of 32
(FlashAttention-2 has kernels for head dims 32, 64, 96, 128, ...; PyTorch's memory-efficient
kernel, which runs fp32 attention, iterates over the head dim 32 at a time): head dim 48
costs as 64.

The defaults are fractions of the data-sheet peaks (planning/machines.py), from published
measurements (docs/scaling.md names them):
  - GEMMs: the plateau is the Maximum Achievable Matmul FLOPS of a bf16 GEMM (A100 SXM 86.9 %
    of 312 TFLOP/s, H100 SXM 80.3 % of 989: "Maximum Achievable Matmul FLOPS comparison
    table", S. Bekman, Machine Learning Engineering); smaller GEMMs fall off as in Calculon's
    A100/H100 tables (Isaev et al., SC23: 0.95 at 128 GFLOP, 0.9 at 16, 0.6 at 1, 0.1 towards
    0), scaled to that plateau. fp32 GEMMs run as TF32, at the same fractions of its peak.
  - attention (bf16/fp16, FlashAttention-2): 50 % of peak at head dim 64 and 73 % at 128 for
    long sequences on an A100 (the range FlashAttention-2's paper gives, Dao 2023), less for
    short ones (the fall-off with sequence length is assumed); on an H100, PyTorch's SDPA
    reached 287-304 TFLOP/s at head dim 128 (pytorch/benchmark #2296): 30 %. fp32 attention
    is the memory-efficient kernel in 3xTF32 (a third of the TF32 peak): 40 % of that
    (assumed: the first FlashAttention's 25-40 % of peak).
  - elementwise: Calculon's memory efficiencies by operator size (0.9 at 100 MB, 0.75 at 10,
    0.6 at 1, 0.3 towards 0) of the HBM bandwidth.
  - a kernel takes at least LAUNCH_S (a launch's latency, assumed); the host-to-device copy
    runs at PCIE_REACHED of the PCIe link (A100: Gen4 x16, 32 GB/s each way; H100/H200:
    Gen5, 64 GB/s); a loader process reads and normalises HOST_BYTES_PER_S (the tutorial's
    HDF5 samples, measured on an AMD EPYC core: docs/scaling.md).
A machine file (JSON, `write_machine_file`) holds the same tables as measured rates.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from planning.machines import Gpu
from utils.errors import UserError

FORMAT = "time-model machine file 1"
DTYPES = ("bf16", "fp16", "fp32")
HEAD_DIM_STEP = 32
LAUNCH_S = 5e-6
PCIE_REACHED = 0.8
HOST_BYTES_PER_S = 1.4e9
PCIE = {"a100-40gb": 32e9, "a100-80gb": 32e9, "h100": 64e9, "h200": 64e9}

# (GEMM FLOPs, fraction of the plateau): Calculon's steps over its 0.95
GEMM_FALLOFF = ((1e6, 0.1 / 0.95), (1e9, 0.6 / 0.95), (16e9, 0.9 / 0.95), (128e9, 1.0))
GEMM_PLATEAU = {"a100": 0.869, "h100": 0.803, "h200": 0.803}
# (key length, fraction of the long-sequence efficiency): assumed
ATTENTION_FALLOFF = ((256, 0.5), (1024, 0.8), (4096, 1.0))
ATTENTION_LONG = {"a100": {64: 0.50, 128: 0.73}, "h100": {64: 0.21, 128: 0.30},
                  "h200": {64: 0.21, 128: 0.30}}
FP32_ATTENTION = 0.40
# (operator bytes, fraction of HBM bandwidth): Calculon's
MEMORY = ((1e4, 0.3), (1e6, 0.6), (1e7, 0.75), (1e8, 0.9))


def dtype_key(dtype: torch.dtype | None) -> str:
    """The tables' name for a matmul input dtype (anything else runs as fp32)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


@dataclass(frozen=True)
class Curve:
    """A rate by size: (size, rate) points, sizes increasing; linear in log(size) between
    them, flat beyond the ends."""

    points: tuple[tuple[float, float], ...]

    def __call__(self, size: float) -> float:
        pts = self.points
        if size <= pts[0][0]:
            return pts[0][1]
        for (s0, r0), (s1, r1) in zip(pts, pts[1:], strict=False):
            if size <= s1:
                w = math.log(size / s0) / math.log(s1 / s0)
                return r0 + w * (r1 - r0)
        return pts[-1][1]

    def problems(self, name: str) -> list[str]:
        pts, out = self.points, []
        if not pts:
            return [f"{name}: no points"]
        if any(s <= 0 or r <= 0 or not math.isfinite(s * r) for s, r in pts):
            out.append(f"{name}: sizes and rates must be positive numbers")
        if any(b[0] <= a[0] for a, b in zip(pts, pts[1:], strict=False)):
            out.append(f"{name}: sizes must increase")
        return out


@dataclass(frozen=True)
class MachineRates:
    """The rates one GPU (and its host) achieves (module docstring)."""

    name: str
    gemm_curves: dict[str, Curve]
    attention_curves: dict[str, dict[int, Curve]]  # dtype -> kernel head dim -> by key length
    memory_curve: Curve
    launch_s: float  # a kernel's floor
    h2d_bytes_per_s: float  # a pinned batch's copy to the GPU
    host_bytes_per_s: float  # a loader process's read and normalisation
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def gemm(self, dtype: str, flops: float) -> float:
        return self.gemm_curves[dtype](flops)

    def memory(self, nbytes: float) -> float:
        return self.memory_curve(nbytes)

    def attention(self, dtype: str, head_dim: int, seq: float) -> float:
        """FLOP/s on the attention's real FLOPs: its kernel's rate at the padded head dim,
        times head_dim / padded."""
        padded = -(-head_dim // HEAD_DIM_STEP) * HEAD_DIM_STEP
        by_dim = self.attention_curves[dtype]
        kernel = min((d for d in by_dim if d >= padded), default=max(by_dim))
        return by_dim[kernel](seq) * head_dim / padded

    # ------------------------------------------------------------ the machine file
    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "name": self.name, "source": self.source,
                "gemm": {d: list(map(list, c.points)) for d, c in self.gemm_curves.items()},
                "attention": {d: {str(h): list(map(list, c.points)) for h, c in by.items()}
                              for d, by in self.attention_curves.items()},
                "memory": list(map(list, self.memory_curve.points)),
                "launch_s": self.launch_s, "h2d_bytes_per_s": self.h2d_bytes_per_s,
                "host_bytes_per_s": self.host_bytes_per_s, **self.extra}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str) -> MachineRates:
        """The rates of a machine file's JSON; a UserError naming `where` and the entry that
        is wrong."""
        if data.get("format") != FORMAT:
            raise UserError(f"{where}: not a machine file (expected \"format\": \"{FORMAT}\"; "
                            "write one with `make gpu-check`)")

        def curve(points: Any, name: str) -> Curve:
            try:
                c = Curve(tuple((float(s), float(r)) for s, r in points))
            except (TypeError, ValueError):
                raise UserError(f"{where}: {name}: expected a list of [size, rate] pairs, "
                                f"got {points!r}") from None
            if c.problems(name):
                raise UserError(f"{where}: {'; '.join(c.problems(name))}")
            return c

        try:
            gemm = {d: curve(p, f"gemm {d}") for d, p in data["gemm"].items()}
            attention = {d: {int(h): curve(p, f"attention {d} head dim {h}")
                             for h, p in by.items()} for d, by in data["attention"].items()}
            memory = curve(data["memory"], "memory")
            scalars = {k: float(data[k]) for k in ("launch_s", "h2d_bytes_per_s",
                                                   "host_bytes_per_s")}
        except KeyError as e:
            raise UserError(f"{where}: missing entry {e}") from None
        except (AttributeError, TypeError, ValueError) as e:
            raise UserError(f"{where}: malformed entry ({e})") from None
        missing = [d for d in DTYPES if d not in gemm or not attention.get(d)]
        if missing:
            raise UserError(f"{where}: no gemm or attention rates for {', '.join(missing)}")
        known = {"format", "name", "source", "gemm", "attention", "memory", *scalars}
        return cls(str(data.get("name", where)), gemm, attention, memory, **scalars,
                   source=str(data.get("source", where)),
                   extra={k: v for k, v in data.items() if k not in known})


def family(gpu: Gpu) -> str:
    return "a100" if gpu.name.startswith("a100") else gpu.name


def default_rates(gpu: Gpu) -> MachineRates:
    """The published defaults for `gpu` (module docstring), as rates."""
    fam = family(gpu)
    gemm = {}
    for d in DTYPES:
        peak = gpu.peak({"bf16": torch.bfloat16, "fp16": torch.float16}.get(d, torch.float32))
        gemm[d] = Curve(tuple((s, f * GEMM_PLATEAU[fam] * peak) for s, f in GEMM_FALLOFF))
    half = gpu.peak(torch.bfloat16)
    attention = {d: {h: Curve(tuple((s, f * e * half) for s, f in ATTENTION_FALLOFF))
                     for h, e in ATTENTION_LONG[fam].items()} for d in ("bf16", "fp16")}
    three_tf32 = gpu.peak(torch.float32) / 3
    attention["fp32"] = {128: Curve(tuple((s, f * FP32_ATTENTION * three_tf32)
                                          for s, f in ATTENTION_FALLOFF))}
    memory = Curve(tuple((s, f * gpu.hbm) for s, f in MEMORY))
    return MachineRates(gpu.name, gemm, attention, memory, LAUNCH_S,
                        PCIE[gpu.name] * PCIE_REACHED, HOST_BYTES_PER_S,
                        source="published defaults (planning/rates.py)")


def read_machine_file(path: str | Path) -> MachineRates:
    """The rates of a machine file; a UserError in one line for a missing or bad file."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise UserError(f"--machine_file {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--machine_file {path}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict):
        raise UserError(f"--machine_file {path}: expected a JSON object")
    return MachineRates.from_json(data, f"--machine_file {path}")


def write_machine_file(path: str | Path, rates: MachineRates) -> None:
    Path(path).write_text(json.dumps(rates.to_json(), indent=1) + "\n")
