"""Shared pieces of the GPU self-test (tests/gpu): the CUDA gate, running the train scripts
on the GPUs, and reading what they logged and saved.

Every test module starts with

    from gpu_utils import require_cuda  # noqa: F401  (the fixture below)
    pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("require_cuda")]

Without a CUDA device the tests skip with the reason "needs CUDA: ..."; under
`make test-gpu` (GPU_TESTS_REQUIRED=1) that is a failure instead, with the reason the
start-up checks give (no GPU assigned, a CPU-only PyTorch, a bad CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path

import helpers
import pytest
import torch
from helpers import CONFIG_FILE, REPO, Tolerances, losses, run_script
from overflow_fault import read_records

REQUIRED = bool(os.environ.get("GPU_TESTS_REQUIRED"))

# Equality between two GPU runs of the same training. A GPU does not add in a fixed order
# (atomics in convolution and attention backward, NCCL's reduction order, split-K GEMMs), so
# two correct runs differ by rounding: ~1e-7 relative per step in fp32, growing over steps.
# The bounds leave room for that and stay far below what a bug changes: a wrong batch, a
# missing all-reduce or a stale graph input moves a parameter by ~lr = 1e-3 per step.
GPU_FP32 = Tolerances(
    loss_rtol=1e-4,     # printed losses have 6 decimals
    param_atol=1e-4,    # 10 % of one Adam step at lr 1e-3
    moment_rtol=1e-3,   # Adam moments, relative to each tensor's largest entry
)
# fp32 everywhere: TF32 matmuls would add ~1e-3 relative noise per product.
FP32_ENV = {"NVIDIA_TF32_OVERRIDE": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
TIMEOUT = 600           # seconds per training subprocess (CUDA start-up, cuDNN autotuning)

# Two mixed-precision runs of the same training on the GPU (printed losses, 16 steps). On the
# CPU, bf16 train.py and train_mp.py (tp 2, cp 2) log losses within 1e-4 of each other
# (tests/test_bf16_layouts.py) and fp16 serial and tp 2 within 6e-7 (tests/
# test_fp16_overflow.py). A GPU adds kernels that do not add in a fixed order (flash
# attention's backward, atomics): the bounds allow 10x (fp16) and 40x (bf16, 8 mantissa bits
# to fp16's 11) that, and stay far below what a broken graph does (a stale input, a frozen LR
# or scale, accumulating gradients move the loss by > 1e-2 within a few steps). Measured on
# no GPU yet: the first GPU run confirms them (docs/gpu_self_test.md).
MIXED_LOSS_RTOL = {"fp16": 1e-3, "bf16": 4e-3}
# fp16 runs with a forced overflow against the serial run: parameters within 3 % of each
# tensor's norm (the CPU spread with and without the ranks' agreement: docs/gpu_self_test.md).
FP16_PARAM_RTOL = 3e-2


def why_no_cuda() -> str:
    """One line: why PyTorch sees no CUDA device here."""
    from distributed.startup_checks import check_gpus_visible
    from utils.errors import LaunchError

    try:
        check_gpus_visible()
    except LaunchError as e:
        return str(e)
    build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
    return f"PyTorch {torch.__version__} ({build}) sees no CUDA device"


@pytest.fixture(scope="session")
def require_cuda() -> None:
    """Session-scoped, so that fixtures which build data for GPU runs can depend on it and
    nothing is generated on a machine that skips."""
    if torch.cuda.is_available():
        return
    reason = f"needs CUDA: {why_no_cuda()}"
    if REQUIRED:
        pytest.fail(f"{reason} (GPU_TESTS_REQUIRED is set: run `make test-gpu` on a GPU node)")
    pytest.skip(reason)


def need_gpus(n: int) -> int:
    """The number of visible GPUs; skips (never fails: it is the node) when fewer than n."""
    have = torch.cuda.device_count()
    if have < n:
        pytest.skip(f"needs {n} GPUs, this node shows {have}")
    return have


def need_module(name: str, install: str) -> None:
    """Skip without `name`; fail under GPU_TESTS_REQUIRED (the tutorial needs it)."""
    try:
        __import__(name)
    except ImportError as e:
        reason = f"needs {name} ({e}): {install}"
        if REQUIRED:
            pytest.fail(reason)
        pytest.skip(reason)


def gpu_run(script: str, args: Sequence[str], data_dir: Path, log_dir: Path,
            nproc: int | None = None, env: dict[str, str] | None = None):
    """Run a train script on the GPU(s) (torchrun with `nproc`); fails the test unless it
    finished, on a GPU, without a traceback."""
    run = run_script(script, list(args), data_dir=data_dir, log_dir=log_dir, nproc=nproc,
                     env_extra=env, timeout=TIMEOUT)
    out = run.output
    assert run.returncode == 0, f"{script}: exit {run.returncode}\n{out[-5000:]}"
    assert "Traceback" not in out, out[-5000:]
    assert "Using GPU" in run.stdout, f"{script} did not run on a GPU\n{run.stdout[-3000:]}"
    return run


def assert_finite_and_learning(run) -> None:
    got = losses(run)
    every = got["initial"] + got["train"] + got["val"]
    assert every and all(math.isfinite(v) for v in every), got
    assert got["val"][-1] < got["initial"][0], f"validation loss did not go down: {got}"


def assert_same_training(run, ref, config: str, world_sizes: tuple[int, int],
                         iters: int) -> None:
    """Same logged losses, final parameters and Adam moments as `ref` (runs on GPUs), within
    GPU_FP32 (helpers.assert_same_training)."""
    helpers.assert_same_training(run, ref, *world_sizes, GPU_FP32, config=config, iters=iters,
                                 kind="GPU")


def peak_memory_gib(run, iters: int) -> float:
    """What the script logs at the end: torch.cuda.max_memory_allocated, in GiB."""
    m = re.search(rf"Finished {iters} iterations; peak memory ([0-9.]+) GB", run.stdout)
    assert m, f"no peak memory line\n{run.stdout[-3000:]}"
    return float(m.group(1))


def config_on_grid(tmp_path: Path, base: str, img_size: tuple[int, int]) -> tuple[str, str]:
    """The repository's config `base` on another `img_size` grid (the tiny data set is
    16 x 32; a smaller grid is read as its crop): (the --yaml_config file, the --config
    name) of a YAML file with that one section. E.g. (12, 28) with patch 4: 3 x 7 tokens,
    split 11 + 10 over cp 2, and into 2 + 1 rows and 4 + 3 columns over h 2 x w 2."""
    from utils.config import read_config

    section = read_config(CONFIG_FILE, base, environ={}).model_dump()
    for key in ("config", "yaml_config", "flags"):  # set by the loader, not config keys
        section.pop(key)
    section["img_size"] = list(img_size)
    name = f"{base}_{img_size[0]}x{img_size[1]}"
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps({name: section}))  # JSON is YAML
    return str(path), name


# ----------------------------------------------------------------- fp16 overflow on one rank

OVERFLOW_STEP, OVERFLOW_PARAM = 3, "blocks.0.mlp.fc1.weight"  # column-parallel over tp


def faulty_run(tmp_path_factory, data: Path, script: str, mp_rank: int, args: Sequence[str],
               nproc: int | None = None):
    """`script` with `args` (fp16 among them) and an inf forced into OVERFLOW_PARAM's
    gradient on model-parallel rank `mp_rank` at OVERFLOW_STEP (tests/overflow_fault.py):
    (run, records by rank)."""
    records = tmp_path_factory.mktemp("records")
    fault = [records, OVERFLOW_PARAM, OVERFLOW_STEP, mp_rank, script, *args]
    run = gpu_run(str(REPO / "tests" / "overflow_fault.py"), fault, data,
                  tmp_path_factory.mktemp("logs"), nproc=nproc, env=FP32_ENV)
    return run, read_records(records)


def skipped(records: dict[int, dict]) -> list[int]:
    """The steps whose optimizer step applied no update."""
    updates = [0.0] + [records[s]["adam_updates"] for s in sorted(records)]
    return [s for s in sorted(records) if updates[s + 1] == updates[s]]
