"""What the processor computes natively, as this process uses it: its class (the vector ISA
of PyTorch's kernels, whether bf16 is native), and how much slower a matmul in an emulated
reduced precision measures.

A CPU without bf16 instructions still runs bf16 autocast, but every bf16 GEMM is emulated,
one to two orders of magnitude slower than fp32 (docs/precision.md).
`amp_mode: auto` (utils/precision.py) therefore asks here before it picks bf16 on a CPU.

The answer comes from PyTorch's own CPU feature detection (cpuinfo, the library oneDNN's
dispatch agrees with), and from what this process lets PyTorch use of it:
  bf16 native: AVX512-BF16 (vector dot products) or AMX-BF16 (tile matmuls), x86; on Arm the
    BF16 extension (`bf16` in /proc/cpuinfo, FEAT_BF16 on macOS) where PyTorch's oneDNN uses it;
  fp16 native: AVX512-FP16 or AMX-FP16, x86; on Arm, oneDNN's own fp16 check;
  the caps: `ATEN_CPU_CAPABILITY` (avx2, avx512, ...) sets the ISA of PyTorch's own kernels
    (torch.backends.cpu.get_cpu_capability() says which), `ONEDNN_MAX_CPU_ISA` the highest ISA
    oneDNN (bf16 matmuls) may use: an instruction above the cap is not native for this run.
`CLASS_CAPS` holds the caps that make a bigger CPU compute like a smaller class: the same
instruction set (what is emulated, the bf16/fp32 ratio), not its clock, cores or fp32 speed.
`CPU_NATIVE_PRECISION` (e.g. `none`, `bf16`, `bf16,fp16`) replaces the detection: to test
the code path of another CPU, or to see what `auto` would do there.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from utils.errors import ConfigError

ENV_OVERRIDE = "CPU_NATIVE_PRECISION"
REDUCED = ("bf16", "fp16")
# x86 feature flags (names as torch._C._cpu._get_cpu_capability reports them) that make a
# reduced precision native: any one of them is enough.
NATIVE_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# oneDNN's x86 ISA levels, lowest first (its dnnl_cpu_isa_t); a cap admits its own level and
# those below it. Its other spellings of the same levels, and the names of "no cap".
ONEDNN_CAP_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")  # the second: oneDNN's old name
ONEDNN_LEVELS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                 "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX10_1_512", "AVX10_1_512_AMX",
                 "AVX10_1_512_AMX_FP16")
ONEDNN_ALIASES = {"AVX512_CORE_FP16": "AVX10_1_512", "AVX512_CORE_AMX": "AVX10_1_512_AMX",
                  "AVX512_CORE_AMX_FP16": "AVX10_1_512_AMX_FP16"}
ONEDNN_UNCAPPED = ("ALL", "DEFAULT")
# The lowest oneDNN level whose kernels use each flag's instructions.
FLAG_LEVEL = {"avx512_bf16": "AVX512_CORE_BF16", "amx_bf16": "AVX10_1_512_AMX",
              "avx512_fp16": "AVX10_1_512", "amx_fp16": "AVX10_1_512_AMX_FP16"}

# The CPU classes the tutorial is measured on, and the caps that make a bigger x86 CPU
# compute in each one's instruction set (tools/tutorial_walk.py --cpu_class).
CLASS_CAPS: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx512_bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "amx": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX10_1_512_AMX"},
}
CAP_VARS = ("ATEN_CPU_CAPABILITY", *ONEDNN_CAP_VARS)


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


def onednn_cap(environ: Mapping[str, str]) -> tuple[str | None, str]:
    """(oneDNN's ISA cap as one of ONEDNN_LEVELS, None for none; the setting as written)."""
    for var in ONEDNN_CAP_VARS:
        value = environ.get(var, "").strip()
        if value:
            level = ONEDNN_ALIASES.get(value.upper(), value.upper())
            if level in ONEDNN_UNCAPPED or level not in ONEDNN_LEVELS:
                return None, f"{var}={value}"  # oneDNN ignores a name it does not know
            return level, f"{var}={value}"
    return None, ""


def cap_allows(cap: str | None, level: str) -> bool:
    return cap is None or ONEDNN_LEVELS.index(cap) >= ONEDNN_LEVELS.index(level)


def is_x86(machine: str) -> bool:
    return machine.lower() in ("x86_64", "amd64", "i686", "x86")


def detect_native(features: dict[str, bool], machine: str, cap: str | None = None,
                  cap_text: str = "", arm_features: frozenset[str] | None = None,
                  onednn: frozenset[str] | None = None) -> CpuPrecision:
    """x86: from the feature flags, the instructions oneDNN's cap `cap` lets it use. Arm:
    the BF16 extension (`arm_features`, the hardware's feature names) where this PyTorch's
    oneDNN runs bf16; `onednn`: the reduced precisions it runs (None: asked of torch)."""
    if features and is_x86(machine):
        native, seen, capped = set(), [], []
        for mode, flags in NATIVE_FLAGS.items():
            for flag in (f for f in flags if features.get(f)):
                if cap_allows(cap, FLAG_LEVEL[flag]):
                    native.add(mode)
                    seen.append(flag)
                else:
                    capped.append(flag)
        every = ", ".join(f for flags in NATIVE_FLAGS.values() for f in flags)
        evidence = ", ".join(seen) or ("" if capped else f"none of {every}")
        if capped:
            evidence += ("; " if seen else "") + f"{', '.join(capped)} above {cap_text}"
        return CpuPrecision(frozenset(native), evidence)
    if onednn is None:
        onednn = frozenset(m for m, ask in (("bf16", torch.ops.mkldnn._is_mkldnn_bf16_supported),
                                            ("fp16", torch.ops.mkldnn._is_mkldnn_fp16_supported))
                           if ask())
    native = {m for m in onednn if m == "fp16" or arm_features is None or "bf16" in arm_features}
    if arm_features is None:
        return CpuPrecision(frozenset(native), f"oneDNN on {machine}")
    if "bf16" not in arm_features:
        return CpuPrecision(frozenset(native), f"no bf16 among the {machine} CPU's features")
    if "bf16" not in onednn:
        return CpuPrecision(frozenset(native), f"bf16 in the {machine} CPU's features, but "
                            "this PyTorch's oneDNN does not run it")
    return CpuPrecision(frozenset(native), f"bf16 in the {machine} CPU's features")


def arm_features(machine: str, system: str) -> frozenset[str] | None:
    """The Arm CPU's feature names (Linux: /proc/cpuinfo `Features`; macOS: FEAT_BF16 as
    `bf16`); None on x86 or where they cannot be read."""
    if is_x86(machine):
        return None
    if system == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"],
                                 capture_output=True, text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
        return frozenset({"bf16"} if out == "1" else set())
    try:
        with open("/proc/cpuinfo") as f:
            line = next(x for x in f if x.lower().startswith("features"))
    except (OSError, StopIteration):
        return None
    return frozenset(line.split(":", 1)[1].split())


def cpu_precision(environ: Mapping[str, str] | None = None) -> CpuPrecision:
    """The native reduced precisions of this CPU as this process may use them (or the ones
    `CPU_NATIVE_PRECISION` names)."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_OVERRIDE):
        return CpuPrecision(parse_override(environ[ENV_OVERRIDE]),
                            f"{ENV_OVERRIDE}={environ[ENV_OVERRIDE]}")
    cap, cap_text = onednn_cap(environ)
    machine = platform.machine()
    return detect_native(cpu_features(), machine, cap, cap_text,
                         arm_features(machine, platform.system()))


@dataclass(frozen=True)
class CpuClass:
    """What a run computes with: the vector ISA of PyTorch's kernels, native bf16 or not
    (and AMX), and the caps in the environment that chose them."""

    machine: str  # platform.machine()
    isa: str  # torch.backends.cpu.get_cpu_capability(): AVX2, AVX512, DEFAULT, SVE256, ...
    precision: CpuPrecision
    amx: bool  # AMX tiles in the hardware and allowed by the cap
    caps: str = ""  # the capping variables set, e.g. "ATEN_CPU_CAPABILITY=avx2 ..."

    @property
    def bf16(self) -> bool:
        return self.precision.is_native("bf16")

    @property
    def name(self) -> str:
        """avx2, avx512, avx512_bf16, amx, arm, arm_bf16, ...: the rows of the tables."""
        if self.amx and self.bf16:
            return "amx"
        family = self.isa.lower()
        if not is_x86(self.machine):
            family = "arm" if family == "default" else f"arm_{family}"
        return family + ("_bf16" if self.bf16 else "")

    def summary(self) -> str:
        """'AVX2, bf16 emulated', 'AVX512 + AMX, native bf16', ..."""
        isa = self.isa if is_x86(self.machine) else f"{self.machine} {self.isa}"
        isa += " + AMX" if self.amx and self.bf16 else ""
        return f"{isa}, {'native bf16' if self.bf16 else 'bf16 emulated'}"

    def describe(self) -> str:
        """One line: the class, why bf16 is native or not, and the caps (what they mean)."""
        caps = (f"; caps {self.caps}: that class's instruction set, not its clock or cores"
                if self.caps else "")
        return f"CPU class {self.name}: {self.summary()} ({self.precision.evidence}){caps}"


def cpu_class(environ: Mapping[str, str] | None = None) -> CpuClass:
    """The class this process computes in (PyTorch's ISA now, the caps of `environ`)."""
    environ = os.environ if environ is None else environ
    precision = cpu_precision(environ)
    cap, _ = onednn_cap(environ)
    amx = bool(cpu_features().get("amx_bf16")) and cap_allows(cap, FLAG_LEVEL["amx_bf16"])
    caps = " ".join(f"{v}={environ[v]}" for v in CAP_VARS if environ.get(v)
                    and (v == "ATEN_CPU_CAPABILITY" or onednn_cap({v: environ[v]})[0]))
    return CpuClass(platform.machine(), torch.backends.cpu.get_cpu_capability(), precision,
                    amx, caps)


def cpu_model() -> str:
    """The processor's model name."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def cpu_name() -> str:
    """The processor's model name, its class as this process uses it, and its core count:
    what every published number names."""
    cls = cpu_class()
    caps = f"; caps {cls.caps}" if cls.caps else ""
    return f"{cpu_model()} ({cls.summary()}{caps}; {os.cpu_count()} CPUs)"


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
