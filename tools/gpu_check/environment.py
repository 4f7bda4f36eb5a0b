"""What the gpu-check runs on: versions, the device and what it supports, and which optional
parts are missing (and what is skipped for each). Written for any device: on a CPU it names
the CPU and says what needs a GPU."""

from __future__ import annotations

import platform
import shutil
import sys
from importlib import metadata
from typing import Any

import torch

from tools.gpu_check.report import Line, one_line
from utils.hardware import cpu_name

# What each optional part is for here, and what is skipped without it.
OPTIONAL = {
    "nvidia-dali": ("DALI", "the ladder's DALI row (the tutorial's step 4)"),
    "nsys": ("Nsight Systems", "nothing here; make test-gpu's nsys tests"),
    "nvidia-ml-py": ("NVML (pynvml)", "nothing: device memory is read with "
                     "torch.cuda.mem_get_info instead"),
}


def capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def supports(device: torch.device) -> dict[str, bool]:
    """bf16, TF32 and FP8 matmuls: native on this device (Ampere: bf16 and TF32; Ada and
    Hopper: FP8). On a CPU, bf16 as utils.precision decides it; no TF32 or FP8."""
    cap = capability(device)
    if cap is None:
        from utils.precision import auto_amp_mode

        return {"bf16": auto_amp_mode(device) == "bf16", "tf32": False, "fp8": False}
    return {"bf16": torch.cuda.is_bf16_supported(), "tf32": cap >= (8, 0),
            "fp8": cap >= (8, 9) and hasattr(torch, "float8_e4m3fn")}


def optional_parts() -> dict[str, str | None]:
    """Version (or path) of each optional part, None where missing."""
    found: dict[str, str | None] = {}
    for name in OPTIONAL:
        if name == "nsys":
            found[name] = shutil.which("nsys")
            continue
        versions = [d.version for d in metadata.distributions()
                    if (d.metadata["Name"] or "").lower().startswith(name)]
        found[name] = versions[0] if versions else None
    return found


def nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def facts(device: torch.device) -> dict[str, Any]:
    """Everything the report's header and environment lines say, as plain values. A GPU
    that cannot be read is said (`gpu_error`), never raised: the report is written anyway."""
    out: dict[str, Any] = {
        "python": platform.python_version(), "executable": sys.executable,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
        else None, "nccl": nccl_version(), "device": str(device), "cpu": cpu_name(),
        "host": platform.node(), "supports": {}, "optional": optional_parts()}
    try:
        out["supports"] = supports(device)
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            free, total = torch.cuda.mem_get_info(device)
            out.update(gpu=props.name, capability=".".join(map(str, capability(device))),
                       gpus_visible=torch.cuda.device_count(), memory_gib=total / 2**30,
                       free_gib=free / 2**30, multiprocessors=props.multi_processor_count)
    except Exception as e:  # noqa: BLE001 - said in the report instead
        out["gpu_error"] = one_line(e)
    return out


def lines(f: dict[str, Any]) -> list[Line]:
    """The report's environment section."""
    versions = (f"torch {f['torch']}, CUDA {f['cuda']}, cuDNN {f['cudnn']}, NCCL {f['nccl']}, "
                f"Python {f['python']}")
    rows = [Line("environment", "versions", "info", versions)]
    if "gpu_error" in f:
        rows.append(Line("environment", "GPU", "FAIL", detail=f"{f['device']} cannot be "
                         f"read: {f['gpu_error']}"))
    elif "gpu" in f:
        rows.append(Line("environment", "GPU", "info",
                         f"{f['gpu']} (sm {f['capability']}), {f['memory_gib']:.1f} GiB, "
                         f"{f['gpus_visible']} visible", f"CPU: {f['cpu']}"))
    else:
        rows.append(Line("environment", "device", "info", f"CPU: {f['cpu']}",
                         "no GPU: the checks that need one are skipped"))
    s = f["supports"]
    if s:
        rows.append(Line("environment", "native precisions", "info",
                         ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in s.items())))
    for name, version in f["optional"].items():
        label, what = OPTIONAL[name]
        rows.append(Line("environment", label, "info" if version else "skip",
                         version or "missing", "" if version else f"skipped: {what}"))
    return rows
