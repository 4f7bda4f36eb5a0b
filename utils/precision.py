"""Mixed precision: which dtype autocast uses (and what `amp_mode: auto` picks on this
hardware) and loss scaling. The kernels whose precision depends on the device (attention,
the patch embedding) are networks/kernels.py."""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

import torch

from utils.hardware import CpuPrecision, cpu_name, cpu_precision, measure_slowdown

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


def choose_precision(amp_mode: str, device: torch.device,
                     cpu: CpuPrecision | None = None) -> Precision:
    """The config's `amp_mode` on `device`, said in one log line (`Precision: ...`): 'auto'
    becomes this hardware's choice, with why; a precision a CPU only emulates is said as a
    warning (once per process and mode) with the slowdown a 1-second matmul probe measured."""
    if device.type != "cpu":
        mode = auto_amp_mode(device) if amp_mode == "auto" else amp_mode
        chosen = f"amp_mode auto -> {mode}" if amp_mode == "auto" else f"amp_mode {mode}"
        log.info(f"Precision: {describe(mode)} on {device.type} ({chosen})")
        return Precision(mode, device.type)
    cpu = cpu or cpu_precision()
    mode = auto_amp_mode(device, cpu) if amp_mode == "auto" else amp_mode
    if mode != "none" and not cpu.is_native(mode):
        warn_emulated(mode, cpu)
        return Precision(mode, device.type)
    why = (f"native on this CPU ({cpu.evidence})" if mode != "none" else
           f"no native bf16 on this CPU ({cpu.evidence})" if amp_mode == "auto" else "")
    chosen = f"amp_mode auto -> {mode}" if amp_mode == "auto" else f"amp_mode {mode}"
    log.info(f"Precision: {describe(mode)} ({chosen}{': ' + why if why else ''})")
    return Precision(mode, device.type)


def describe(mode: str) -> str:
    """What the step computes in, for the log."""
    return {"none": "fp32, no autocast", "bf16": "bf16 autocast",
            "fp16": "fp16 autocast with loss scaling"}[mode]


@functools.cache
def warn_emulated(mode: str, cpu: CpuPrecision) -> None:
    rates = measure_slowdown(mode)
    log.warning(f"Precision: {describe(mode)}, but amp_mode {mode} is emulated on this CPU "
                f"({cpu_name()}; {cpu.evidence}): a {rates.n}^3 matmul measured "
                f"{rates.slowdown:.1f}x the time of fp32 ({rates.reduced:.1f} vs "
                f"{rates.fp32:.1f} GFLOP/s); amp_mode auto picks "
                f"{auto_amp_mode(torch.device('cpu'), cpu)} here")
