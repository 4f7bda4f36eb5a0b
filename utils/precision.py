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
    """The config's `amp_mode` on `device`: 'auto' becomes this hardware's choice, said in
    the log; a precision a CPU only emulates gets a warning (one line, once per process and
    mode) with the slowdown a 1-second matmul probe measured."""
    if device.type != "cpu":
        mode = auto_amp_mode(device) if amp_mode == "auto" else amp_mode
        return Precision(mode, device.type)
    cpu = cpu or cpu_precision()
    mode = amp_mode
    if amp_mode == "auto":
        mode = auto_amp_mode(device, cpu)
        why = (f"native on this CPU ({cpu.evidence})" if mode != "none" else
               f"no native bf16 on this CPU ({cpu.evidence})")
        log.info(f"amp_mode auto -> {mode}: {why}")
    elif mode != "none" and not cpu.is_native(mode):
        warn_emulated(mode, cpu)
    return Precision(mode, device.type)


@functools.cache
def warn_emulated(mode: str, cpu: CpuPrecision) -> None:
    rates = measure_slowdown(mode)
    log.warning(f"amp_mode {mode} is emulated on this CPU ({cpu_name()}; {cpu.evidence}): "
                f"a {rates.n}^3 matmul measured {rates.slowdown:.1f}x the time of fp32 "
                f"({rates.reduced:.1f} vs {rates.fp32:.1f} GFLOP/s); amp_mode auto "
                f"picks {auto_amp_mode(torch.device('cpu'), cpu)} here")
