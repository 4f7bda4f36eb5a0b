"""GPU self-test, the platform pieces the tutorial steps rely on:

  - TF32: the process set-up turns TF32 matmuls on, and NVIDIA_TF32_OVERRIDE=0 turns them off
    (the torch flag and the numbers a matmul gives);
  - DALI's GPU pipeline yields the PyTorch loader's batches, and a training run fed by it logs
    the same losses;
  - nsys: the capture range opens and closes around the profiled epoch, a rerun overwrites
    its report, and CUDA-graph replays are traced kernel by kernel.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
from gpu_utils import (
    FP32_ENV,
    GPU_FP32,
    TIMEOUT,
    gpu_run,
    losses,
    need_module,
    require_cuda,  # noqa: F401  (fixture used through pytestmark)
)
from helpers import REPO, child_env

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("require_cuda")]

DALI_INSTALL = "pip install nvidia-dali-cuda120 (or the wheel for your CUDA)"

# ----------------------------------------------------------------- TF32

TF32_PROBE = """\
import json, torch
from distributed.comm import init_process
_, device = init_process()
g = torch.Generator(device=device).manual_seed(0)
a = torch.randn(1024, 1024, device=device, generator=g)
b = torch.randn(1024, 1024, device=device, generator=g)
ref = a.double() @ b.double()
err = ((a @ b).double() - ref).abs().max() / ref.abs().max()
print("TF32 " + json.dumps({"matmul": torch.backends.cuda.matmul.allow_tf32,
                            "cudnn": torch.backends.cudnn.allow_tf32, "err": err.item(),
                            "cc": list(torch.cuda.get_device_capability(device))}))
"""
# A 1024-long fp32 dot product is exact to ~1e-7 of the result's scale; rounding the inputs
# to TF32's 10-bit mantissa costs ~1e-4.
TF32_ERR = 2e-5


def tf32_probe(**env: str) -> dict:
    r = subprocess.run([sys.executable, "-c", TF32_PROBE], cwd=REPO, env=child_env(env),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("TF32 ")]
    assert line, r.stdout
    return json.loads(line[0][5:])


def test_tf32_is_on_by_default_and_nvidia_tf32_override_0_turns_it_off():
    """TF32 matmuls are on by default and NVIDIA_TF32_OVERRIDE=0 turns them off (flags and
    numbers)."""
    on, off = tf32_probe(), tf32_probe(NVIDIA_TF32_OVERRIDE="0")
    assert (on["matmul"], on["cudnn"]) == (True, True), on
    assert (off["matmul"], off["cudnn"]) == (False, False), off
    assert off["err"] < TF32_ERR, off
    if tuple(on["cc"]) >= (8, 0):  # Ampere and newer have TF32 tensor cores
        assert on["err"] > TF32_ERR, f"TF32 flag on but the matmul is exact: {on}"


# ----------------------------------------------------------------- DALI on the GPU

@pytest.mark.parametrize("workers", [0, 2])
def test_dali_gpu_pipeline_gives_the_pytorch_loaders_batches(tiny_params, workers):
    """DALI's GPU pipeline yields the PyTorch loader's batches, in order, for two epochs."""
    need_module("nvidia.dali", DALI_INSTALL)
    from data.dali import get_data_loader_dali
    from data.loader import get_data_loader

    torch.cuda.set_device(0)
    cfg, batch = tiny_params, tiny_params.local_batch_size
    ref_loader, _, ref_sampler = get_data_loader(cfg.replace(num_data_workers=0),
                                                 cfg.train_data_path, True, batch_size=batch)
    loader, _, sampler = get_data_loader_dali(cfg.replace(num_data_workers=workers),
                                              cfg.train_data_path, True, batch_size=batch)
    try:
        for epoch in (1, 2):
            sampler.set_epoch(epoch)
            ref_sampler.set_epoch(epoch)
            n = 0
            for (inp, tar), (ref_inp, ref_tar) in zip(loader, ref_loader, strict=True):
                assert inp.device.type == "cuda" and inp.dtype == torch.float32
                # (x - mean) / std, on the GPU: equal to the CPU's result up to rounding
                torch.testing.assert_close(inp.cpu(), ref_inp, rtol=0, atol=1e-5)
                torch.testing.assert_close(tar.cpu(), ref_tar, rtol=0, atol=1e-5)
                n += 1
            assert n == len(ref_loader) > 0
    finally:
        loader.close()


def test_training_fed_by_dali_on_the_gpu_logs_the_pytorch_loaders_losses(tiny_data,
                                                                          tmp_path_factory):
    """A run fed by DALI logs the losses of one fed by the PyTorch loader (fp32)."""
    need_module("nvidia.dali", DALI_INSTALL)
    args = ["--config=tiny", "--num_iters=16"]
    ref = gpu_run("train.py", [*args, "--data_loader_config=pytorch"], tiny_data,
                  tmp_path_factory.mktemp("pytorch"), env=FP32_ENV)
    dali = gpu_run("train.py", [*args, "--data_loader_config=dali", "--num_data_workers=2"],
                   tiny_data, tmp_path_factory.mktemp("dali"), env=FP32_ENV)
    got, want = losses(dali), losses(ref)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=GPU_FP32.loss_rtol), (key, got, want)


# ----------------------------------------------------------------- nsys

def nsys_command(script: str, *args: str, **env: str) -> list[str]:
    """The command line site/task.sh builds for one profiled task."""
    shell = (f"source site/task.sh; task_command {shlex.join([script, *args])}; "
             "printf '%s\\0' \"${TASK_CMD[@]}\"")
    base = {"ENABLE_PROFILING": "1", "WORLD_SIZE": "1", "RANK": "0",
            "PYTHON": sys.executable, **env}
    r = subprocess.run(["bash", "-c", shell], cwd=REPO, env=child_env(base),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    cmd = r.stdout.rstrip("\0").split("\0")
    assert cmd[:2] == ["nsys", "profile"], cmd
    return cmd


def run_profiled(cmd: list[str], tiny_data, log_dir, epoch: int) -> str:
    env = child_env({"DATA_DIR": str(tiny_data), "LOG_DIR": str(log_dir),
                     "ENABLE_PROFILING": "1", "PROFILE_WITH_NSYS": "1",
                     "PROFILE_EPOCH": str(epoch)})
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    assert "Profiling window closed (nsys capture range ends here)" in out, out[-3000:]
    return out


def nsys_stats(report, *names: str) -> str:
    """`nsys stats` as CSV, with the first report name this nsys knows (they were renamed)."""
    for name in names:
        r = subprocess.run(["nsys", "stats", "--force-export=true", "--format", "csv",
                            "--report", name, str(report)], capture_output=True, text=True,
                           timeout=300)
        if r.returncode == 0 and "could not be found" not in r.stderr + r.stdout:
            return r.stdout
    pytest.fail(f"nsys stats knows none of {names}: {r.stderr[-2000:]}")


@pytest.fixture
def nsys() -> str:
    path = shutil.which("nsys")
    if path is None:
        pytest.skip("needs nsys (Nsight Systems) on PATH")
    return path


def test_nsys_capture_range_opens_closes_and_a_rerun_overwrites(nsys, tiny_data, tmp_path):
    """nsys records the profiled epoch's NVTX ranges, and a rerun overwrites its report."""
    prof = tmp_path / "prof"
    prof.mkdir()
    cmd = nsys_command("train.py", "--config=tiny", "--num_iters=16",
                       LOG_DIR=str(prof), PROFILE_OUTPUT="tiny")
    for _ in range(2):  # the second run must overwrite tiny.nsys-rep (nsys -f true)
        run_profiled(cmd, tiny_data, tmp_path / "logs", epoch=2)
    report = prof / "tiny.nsys-rep"
    assert report.is_file(), sorted(p.name for p in prof.iterdir())
    ranges = nsys_stats(report, "nvtx_sum", "nvtxsum")
    for name in ("forward", "backward", "optimizer", "data copy in"):
        assert name in ranges, f"NVTX range {name!r} missing from the capture\n{ranges}"


def test_nsys_traces_cuda_graph_replays_kernel_by_kernel(nsys, tiny_data, tmp_path):
    """nsys traces a CUDA-graph replay kernel by kernel (--cuda-graph-trace=node).

    Epoch 2 of the graphs script is all replays (capture after 3 of epoch 1's 8 steps).
    Traced per graph, its kernels would be hidden inside one block per replay and the
    kernel summary would show only the few eager kernels around the replay (loss sums, NaN
    checks); traced per node it lists the forward and backward kernels."""
    prof = tmp_path / "prof"
    prof.mkdir()
    cmd = nsys_command("train_mp_graphs.py", "--config=tiny", "--num_iters=16",
                       "--graph_warmup=3", LOG_DIR=str(prof), PROFILE_OUTPUT="graphs")
    assert "--cuda-graph-trace=node" in cmd
    run_profiled(cmd, tiny_data, tmp_path / "logs", epoch=2)
    kernels = nsys_stats(prof / "graphs.nsys-rep", "cuda_gpu_kern_sum", "gpukernsum")
    lines = kernels.splitlines()
    header = next((i for i, line in enumerate(lines) if "Name" in line and "," in line), None)
    assert header is not None, kernels
    rows = [line for line in lines[header + 1:] if line.count(",") >= 3]
    assert len(rows) >= 15, f"only {len(rows)} kernels traced in the replay epoch\n{kernels}"
