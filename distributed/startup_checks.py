"""Checks at process start-up that turn two silent GPU failures into one-line errors.

    check_torch_version()    PyTorch older than MIN_TORCH: stop before the process group is
                             set up (an old image fails there with a TypeError, or hangs).
    check_gpus_visible()     GPUs were requested or assigned to this task, but PyTorch sees
                             none: stop instead of training on the CPU with gloo.
    run_startup_checks()     both, in that order.

Both raise LaunchError (one line; `run_main` prints `error: ...` and exits 2). Everything
they read can be injected (version string, environment, device count), so they are tested
without a GPU. From a shell, `python -m distributed.startup_checks` runs them in the current
environment (e.g. inside a job step) and prints what it found.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping

from utils.errors import LaunchError

# Why this minimum:
#   - init_process_group(device_id=...) (distributed/comm.py) is not in older releases;
#   - with device_id, PyTorch 2.7.0 turns on NCCL's non-blocking mode, which hangs at random
#     with NCCL 2.26 (pytorch/pytorch#153960); 2.7.1 turns that default off again;
#   - torch.amp.GradScaler(device), CPU fused Adam and torch.is_autocast_enabled(device) need
#     2.3-2.4, below this anyway.
# The test suite runs with TESTED_TORCH.
MIN_TORCH = (2, 7, 1)
TESTED_TORCH = "2.13"

# Variables SLURM sets in a job or step that got GPUs (sbatch/srun OUTPUT ENVIRONMENT
# VARIABLES): assigned GPU ids, GPU counts, and what --gpus* asked for.
SLURM_GPU_VARS = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE", "SLURM_GPUS",
                  "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK", "SLURM_GPUS_PER_SOCKET")


def parse_version(text: str) -> tuple[int, int, int]:
    """'2.10.0a0+b4e4ee81d3' -> (2, 10, 0): the numeric release, local and pre-release tags
    dropped (NVIDIA's containers ship such builds)."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        raise ValueError(f"not a version: {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def torch_version_problem(version: str) -> str | None:
    """The error line for a PyTorch `version` that is too old, or None when it is new enough."""
    try:
        found = parse_version(version)
    except ValueError:
        return None  # a source build with an odd tag: let it try
    if found >= MIN_TORCH:
        return None
    need = ".".join(map(str, MIN_TORCH))
    return (f"PyTorch {version} is too old: this code needs PyTorch >= {need} (tested with "
            f"{TESTED_TORCH}); use a newer container image or a venv with a newer torch "
            "(see site/README.md)")


def check_torch_version(version: str | None = None) -> None:
    """Raise LaunchError when PyTorch (`version`, default: the imported torch) is too old."""
    if version is None:
        import torch

        version = torch.__version__
    problem = torch_version_problem(str(version))
    if problem:
        raise LaunchError(problem)


def _hides_all_gpus(value: str) -> bool:
    """CUDA_VISIBLE_DEVICES='' or '-1': the user hid every GPU on purpose."""
    first = value.split(",")[0].strip()
    return first == "" or first.startswith("-")


def _gpu_count_says_none(name: str, value: str) -> bool:
    """Counts like SLURM_GPUS_PER_NODE='0' or 'a100:0' mean no GPU."""
    if name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        return False  # lists of GPU ids: '0' is GPU number 0
    last = value.rsplit(":", 1)[-1].strip()
    return last.isdigit() and int(last) == 0


def gpu_request(environ: Mapping[str, str]) -> str | None:
    """'NAME=value' of the first variable showing that GPUs were requested or assigned to
    this process, or None. CUDA_VISIBLE_DEVICES counts when it names devices; set to '' or
    '-1' it means "no GPU, on purpose" and nothing else counts."""
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and _hides_all_gpus(cvd):
        return None
    for name in SLURM_GPU_VARS:
        value = environ.get(name, "").strip()
        if value and not _gpu_count_says_none(name, value):
            return f"{name}={value}"
    tres = environ.get("SLURM_TRES_PER_TASK", "")
    if "gpu" in tres:
        return f"SLURM_TRES_PER_TASK={tres}"
    if cvd:
        return f"CUDA_VISIBLE_DEVICES={cvd}"
    return None


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def _torch_is_cpu_only() -> bool:
    import torch

    return torch.version.cuda is None


def gpus_missing_problem(environ: Mapping[str, str], device_count: int,
                         cpu_only_build: bool) -> str | None:
    """The error line when GPUs were requested/assigned but `device_count` is 0, else None."""
    request = gpu_request(environ)
    if request is None or device_count > 0:
        return None
    head = f"GPUs were requested for this task ({request}) but PyTorch sees no CUDA device"
    if cpu_only_build:
        import torch

        why = (f"this PyTorch ({torch.__version__}) is a CPU-only build: install a CUDA build "
               "or use the site's GPU container")
    elif environ.get("CUDA_VISIBLE_DEVICES"):
        why = (f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']} names no GPU this task "
               "can use (SITE_CUDA_VISIBLE_DEVICES must only reorder the GPUs the task sees)")
    else:
        why = "check the GPU driver and modules (nvidia-smi in the same job step)"
    return f"{head}: {why}; refusing to train on the CPU"


def check_gpus_visible(environ: Mapping[str, str] | None = None,
                       device_count: int | Callable[[], int] | None = None,
                       cpu_only_build: bool | None = None) -> None:
    """Raise LaunchError when GPUs were requested or assigned (SLURM's GPU variables,
    CUDA_VISIBLE_DEVICES) but CUDA sees none. Defaults: os.environ,
    torch.cuda.device_count(), whether this torch was built without CUDA."""
    environ = os.environ if environ is None else environ
    if gpu_request(environ) is None:
        return  # nothing was asked for: a CPU run is what the user wants
    if device_count is None:
        device_count = _cuda_device_count
    count = device_count() if callable(device_count) else int(device_count)
    cpu_only = _torch_is_cpu_only() if cpu_only_build is None else cpu_only_build
    problem = gpus_missing_problem(environ, count, cpu_only)
    if problem:
        raise LaunchError(problem)


def run_startup_checks(environ: Mapping[str, str] | None = None) -> None:
    """Both checks; call first thing in process set-up, before init_process_group."""
    check_torch_version()
    check_gpus_visible(environ)


def main() -> int:
    import torch

    try:
        run_startup_checks()
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    request = gpu_request(os.environ) or "no GPU requested"
    print(f"ok: PyTorch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"{torch.cuda.device_count()} CUDA device(s) visible; {request}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
