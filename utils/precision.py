"""Mixed precision: which dtype autocast uses (and what `amp_mode: auto` picks on this
hardware) and loss scaling. The kernels whose precision depends on the device (attention,
the patch embedding) are networks/kernels.py."""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

import torch

from utils.hardware import (
    CpuPrecision,
    MatmulRates,
    cpu_name,
    cpu_precision,
    measure_slowdown,
)

log = logging.getLogger("train")


def auto_amp_mode(device: torch.device, cpu: CpuPrecision | None = None) -> str:
    """What `amp_mode: auto` means on `device`: bf16 on GPUs that have it (Ampere and
    newer), fp16 on older GPUs, bf16 on CPUs that run it natively, otherwise none (an
    emulated bf16 GEMM can be 100x slower than fp32)."""
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    cpu = cpu or cpu_precision()
    return "bf16" if cpu.is_native("bf16") else "none"


def autocast_dtype(amp_mode: str) -> torch.dtype | None:
    return {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[amp_mode]


@dataclass(frozen=True)
class Precision:
    """The precision a run computes in, decided once at start-up (`choose_precision`):
    autocast in `mode` ('none', 'fp16' or 'bf16', never 'auto') on `device_type`."""

    mode: str
    device_type: str = "cpu"

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype (None: fp32, no autocast)."""
        return autocast_dtype(self.mode)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward pass's autocast context (mode 'none': a null context)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """Loss scaling keeps fp16 gradients from underflowing; bf16 and fp32 need none."""
        return torch.amp.GradScaler(self.device_type, enabled=self.mode == "fp16")


def choose_precision(amp_mode: str, device: torch.device, cpu: CpuPrecision | None = None,
                     config: str | None = None) -> Precision:
    """The config's `amp_mode` on `device`, said in one log line (`Precision: ...`, see
    `precision_line`), before any work; a precision the CPU only emulates is a warning, once
    per process and mode."""
    precision, line, emulated = precision_line(amp_mode, device, cpu, config)
    if emulated:
        warn_once(line)
    else:
        log.info(line)
    return precision


def precision_line(amp_mode: str, device: torch.device, cpu: CpuPrecision | None = None,
                   config: str | None = None) -> tuple[Precision, str, bool]:
    """(the precision, its line, whether the CPU emulates it). 'auto' becomes this
    hardware's choice, with why. An emulated precision's line says what it costs here (a
    matmul probe of about a second, once per process: `emulated_cost`) and what to run
    instead (`config`: the config to name in the suggested command)."""
    cpu = None if device.type != "cpu" else cpu or cpu_precision()
    mode = auto_amp_mode(device, cpu) if amp_mode == "auto" else amp_mode
    precision = Precision(mode, device.type)
    chosen = f"amp_mode auto -> {mode}" if amp_mode == "auto" else f"amp_mode {mode}"
    if cpu is None:
        return precision, f"Precision: {describe(mode)} on {device.type} ({chosen})", False
    if mode != "none" and not cpu.is_native(mode):
        return precision, emulated_line(mode, cpu, config), True
    why = (f"native on this CPU ({cpu.evidence})" if mode != "none" else
           f"no native bf16 on this CPU ({cpu.evidence})" if amp_mode == "auto" else "")
    return precision, f"Precision: {describe(mode)} ({chosen}{': ' + why if why else ''})", False


NAMES = {"none": "fp32", "bf16": "bf16", "fp16": "fp16"}


def describe(mode: str) -> str:
    """What the step computes in, for the log."""
    return {"none": "fp32, no autocast", "bf16": "bf16 autocast",
            "fp16": "fp16 autocast with loss scaling"}[mode]


@functools.cache
def emulated_cost(mode: str) -> MatmulRates:
    """fp32 and `mode` matmul rates on this CPU, measured once per process."""
    return measure_slowdown(mode)


def emulated_line(mode: str, cpu: CpuPrecision, config: str | None = None) -> str:
    """The warning for a precision this CPU emulates: what its matmuls cost here (a probe
    of about a second), what measures a whole step, and what trains at full speed."""
    rates = emulated_cost(mode)
    auto = NAMES[auto_amp_mode(torch.device("cpu"), cpu)]
    return (f"Precision: {describe(mode)}, but amp_mode {mode} is emulated on this CPU "
            f"({cpu_name()}; {cpu.evidence}): a {rates.n}^3 matmul measured "
            f"{rates.slowdown:.1f}x the time of fp32 ({rates.reduced:.1f} vs "
            f"{rates.fp32:.1f} GFLOP/s). A whole step in {mode} against fp32, side by side, "
            f"in about a minute: python -m bench.bench_step --config {config or '<config>'} "
            f"--amp_modes none {mode}; full speed here: --amp_mode auto (trains in {auto})")


@functools.cache
def warn_once(line: str) -> None:
    log.warning(line)
