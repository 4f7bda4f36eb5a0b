"""What the processor computes natively: which reduced precisions its matrix units run in
hardware, and how much slower a matmul in an emulated one measures.

A CPU without bf16 instructions still runs bf16 autocast, but every bf16 GEMM is emulated,
two orders of magnitude slower than fp32 (docs/benchmarks.md).
`amp_mode: auto` (utils/precision.py) therefore asks here before it picks bf16 on a CPU.

The answer comes from PyTorch's own CPU feature detection (cpuinfo, the library oneDNN's
dispatch agrees with), not from parsing /proc/cpuinfo:
  bf16 native: AVX512-BF16 (vector dot products) or AMX-BF16 (tile matmuls), x86;
  fp16 native: AVX512-FP16 or AMX-FP16, x86;
  on other architectures, oneDNN's own bf16/fp16 hardware checks.
`CPU_NATIVE_PRECISION` (e.g. `none`, `bf16`, `bf16,fp16`) replaces the detection: to test
the code path of another CPU, or to see what `auto` would do there.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass

import torch

from utils.errors import ConfigError

ENV_OVERRIDE = "CPU_NATIVE_PRECISION"
REDUCED = ("bf16", "fp16")
# x86 feature flags (names as torch._C._cpu._get_cpu_capability reports them) that make a
# reduced precision native: any one of them is enough.
NATIVE_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class CpuPrecision:
    """The reduced precisions this CPU runs natively, and what that was decided from."""

    native: frozenset[str]
    evidence: str

    def is_native(self, mode: str) -> bool:
        return mode in self.native


def cpu_features() -> dict[str, bool]:
    """PyTorch's CPU feature flags ({} where this PyTorch does not expose them)."""
    probe = getattr(getattr(torch._C, "_cpu", None), "_get_cpu_capability", None)
    if probe is None:
        return {}
    try:
        return {k: v for k, v in probe().items() if isinstance(v, bool)}
    except RuntimeError:
        return {}


def parse_override(value: str) -> frozenset[str]:
    """`CPU_NATIVE_PRECISION`'s value -> the set of native precisions (ConfigError if bad)."""
    names = {v.strip().lower() for v in value.split(",") if v.strip()}
    if names == {"none"}:
        return frozenset()
    bad = names - set(REDUCED)
    if bad or not names:
        raise ConfigError(f"{ENV_OVERRIDE}={value!r}: expected 'none' or a comma-separated "
                          f"list of {', '.join(REDUCED)}")
    return frozenset(names)


def detect_native(features: dict[str, bool], machine: str) -> CpuPrecision:
    """Decide from x86 feature flags; on other architectures ask oneDNN."""
    if features and machine.lower() in ("x86_64", "amd64", "i686", "x86"):
        native, seen = set(), []
        for mode, flags in NATIVE_FLAGS.items():
            present = [f for f in flags if features.get(f)]
            if present:
                native.add(mode)
                seen += present
        every = ", ".join(f for flags in NATIVE_FLAGS.values() for f in flags)
        return CpuPrecision(frozenset(native), ", ".join(seen) or f"none of {every}")
    native = set()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # on ARM: the bf16 extension itself
        native.add("bf16")
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        native.add("fp16")
    return CpuPrecision(frozenset(native), f"oneDNN on {machine}")


def cpu_precision(environ: dict[str, str] | None = None) -> CpuPrecision:
    """The native reduced precisions of this CPU (or the ones `CPU_NATIVE_PRECISION` names)."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_OVERRIDE):
        return CpuPrecision(parse_override(environ[ENV_OVERRIDE]),
                            f"{ENV_OVERRIDE}={environ[ENV_OVERRIDE]}")
    return detect_native(cpu_features(), platform.machine())


def cpu_name() -> str:
    """The processor's model name, its vector ISA as PyTorch uses it, and its core count."""
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or name
    return f"{name} ({torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs)"


@dataclass(frozen=True)
class MatmulRates:
    """GFLOP/s of one n x n x n matmul in fp32 and in a reduced precision."""

    n: int
    fp32: float
    reduced: float

    @property
    def slowdown(self) -> float:
        """Time of the reduced-precision matmul / time of the fp32 one."""
        return self.fp32 / self.reduced


def matmul_gflops(dtype: torch.dtype, n: int, seconds: float) -> float:
    """Best rate of repeated n^3 matmuls within about `seconds` (at least two calls)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # first call: oneDNN builds its kernel
    best, end = float("inf"), time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        torch.mm(a, b)
        now = time.perf_counter()
        best = min(best, now - start)
        if now > end:
            return 2 * n**3 / best / 1e9


def measure_slowdown(mode: str, n: int = 256, seconds: float = 1.0) -> MatmulRates:
    """About `seconds` in all: fp32 and `mode` matmul rates on the CPU. 256^3 is a few
    milliseconds even where bf16 is emulated, so the probe stays within its time."""
    return MatmulRates(n, matmul_gflops(torch.float32, n, seconds / 3),
                       matmul_gflops(DTYPES[mode], n, seconds * 2 / 3))
