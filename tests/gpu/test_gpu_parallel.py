"""GPU self-test, the parallel layouts on NCCL: what a first model-parallel GPU run would hit
first. Each test's first docstring line says what it proves (docs/gpu_self_test.md lists
them with their GPUs and times). Training runs use the tiny data set and config (16 x 32
grid, 16 steps unless said), as subprocesses launched by torchrun on this node's GPUs.

Tolerances: GPU_FP32 (gpu_utils.py) for fp32 runs, MIXED_LOSS_RTOL for the printed losses of
fp16/bf16 runs, FP16_PARAM_RTOL for the forced-overflow runs' parameters.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
from gpu_utils import (
    FP16_PARAM_RTOL,
    FP32_ENV,
    MIXED_LOSS_RTOL,
    OVERFLOW_STEP,
    TIMEOUT,
    assert_same_training,
    config_on_grid,
    faulty_run,
    gpu_run,
    losses,
    need_gpus,
    require_cuda,  # noqa: F401  (fixture used through pytestmark)
    skipped,
)
from helpers import REPO, final_checkpoint, run_script, srun_on_two_nodes

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("require_cuda")]

ITERS = 16
GRAPH_CAPTURED = "Capturing the training step in a CUDA graph after {} warm-up steps"


def tiny(*flags: str, iters: int = ITERS) -> list[str]:
    return ["--config=tiny", f"--num_iters={iters}", *flags]


def need_amp(amp: str) -> None:
    if amp == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name()} has no bf16")


# ----------------------------------------------------------------- CUDA graphs, tp 2

@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_graphed_tp2_step_trains_like_the_eager_one_with_compile_and_fused_adam(
        tiny_data, tmp_path_factory, amp):
    """tp 2 in a CUDA graph (collectives, compiled model, fused capturable Adam, fp16 loss
    scaling or bf16) logs the eager step's losses within MIXED_LOSS_RTOL."""
    need_gpus(2)
    need_amp(amp)
    flags = tiny("--tp=2", f"--amp_mode={amp}", "--enable_jit", "--enable_fused")
    eager = gpu_run("train_mp.py", flags, tiny_data, tmp_path_factory.mktemp("eager"),
                    nproc=2)
    graphs = gpu_run("train_mp_graphs.py", [*flags, "--graph_warmup=3"], tiny_data,
                     tmp_path_factory.mktemp("graphs"), nproc=2)
    assert GRAPH_CAPTURED.format(3) in graphs.output, graphs.output[-3000:]
    got, want = losses(graphs), losses(eager)
    assert want["train"] and len(got["train"]) == len(want["train"]), (got, want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=MIXED_LOSS_RTOL[amp]), (key, got, want)


def test_graphed_ddp_warms_up_11_steps_and_trains_like_eager_ddp(tiny_data, tmp_path_factory):
    """dp 2 in a CUDA graph (DDP's all-reduce captured) warms up >= 11 steps whatever
    --graph_warmup says, and trains like eager DDP (fp32, GPU_FP32)."""
    need_gpus(2)
    eager = gpu_run("train_mp.py", tiny(), tiny_data, tmp_path_factory.mktemp("eager"),
                    nproc=2, env=FP32_ENV)
    graphs = gpu_run("train_mp_graphs.py", tiny("--graph_warmup=3"), tiny_data,
                     tmp_path_factory.mktemp("graphs"), nproc=2, env=FP32_ENV)
    assert "--graph_warmup 3 raised to 11" in graphs.output, graphs.output[-3000:]
    assert GRAPH_CAPTURED.format(11) in graphs.output, graphs.output[-3000:]
    assert_same_training(graphs, eager, "tiny", (2, 2), ITERS)


# ----------------------------------------------------------------- fp16 overflow on one rank

@pytest.mark.parametrize("script, flags", [("train_mp.py", ()),
                                           ("train_mp_graphs.py", ("--graph_warmup=3",))],
                         ids=["eager", "graphed"])
def test_an_overflow_on_one_tp_rank_is_skipped_by_both_on_nccl(tiny_data, tmp_path_factory,
                                                               script, flags):
    """An inf in one tp rank's shard gradient makes both tp ranks skip that step with one
    loss scale, as the serial run does (eager, and after a graph replay), over NCCL."""
    need_gpus(2)
    serial, serial_records = faulty_run(tmp_path_factory, tiny_data, "train.py", 0,
                                        tiny("--amp_mode=fp16", iters=8))
    run, records = faulty_run(tmp_path_factory, tiny_data, script, 1,
                              tiny("--amp_mode=fp16", "--tp=2", *flags, iters=8), nproc=2)
    want = skipped(serial_records[0])
    assert OVERFLOW_STEP in want, serial_records  # the fault did overflow the serial run
    assert sorted(records) == [0, 1], records
    for rank, mine in records.items():
        assert skipped(mine) == want, f"rank {rank} skipped {skipped(mine)}, serial {want}"
        scales = [mine[s]["scale"] for s in sorted(mine)]
        assert scales == [serial_records[0][s]["scale"] for s in sorted(serial_records[0])], \
            (rank, mine, serial_records)
    a = final_checkpoint(run.exp_dir("tiny", 2, kind="GPU"), 8)["model"]
    b = final_checkpoint(serial.exp_dir("tiny", 1, kind="GPU"), 8)["model"]
    for name, t in b.items():
        err = ((a[name].float() - t.float()).norm() / t.float().norm()).item()
        assert err <= FP16_PARAM_RTOL, f"{name}: {err:.2%} from the serial run's"


# ----------------------------------------------------------------- DDP, cp, AFNO mesh on NCCL

@pytest.mark.parametrize("gpus, config, flags", [
    (2, "tiny", ("--cp=2",)),
    (4, "tiny_afno", ("--h_parallel_size=2", "--w_parallel_size=2")),
], ids=["cp2_uneven_tokens", "afno_h2xw2_uneven_tiles"])
def test_uneven_splits_train_like_one_gpu_on_nccl(tiny_data, tmp_path_factory, gpus, config,
                                                  flags):
    """cp 2 over 21 tokens (11 + 10: the padded all-gather/reduce-scatter), and the AFNO on
    an h 2 x w 2 mesh of 3 x 7 tokens (the complex all_to_all_single of the distributed
    FFT, uneven tiles) train like one GPU (fp32, GPU_FP32)."""
    need_gpus(gpus)
    yaml, name = config_on_grid(tmp_path_factory.mktemp("config"), config, (12, 28))
    args = [f"--yaml_config={yaml}", f"--config={name}", f"--num_iters={ITERS}"]
    one = gpu_run("train.py", args, tiny_data, tmp_path_factory.mktemp("one_gpu"),
                  env=FP32_ENV)
    split = gpu_run("train_mp.py", [*args, *flags], tiny_data,
                    tmp_path_factory.mktemp("split"), nproc=gpus, env=FP32_ENV)
    assert "Layout: DP = 1," in split.stdout, split.stdout[-3000:]
    assert_same_training(split, one, name, (gpus, 1), ITERS)


# ----------------------------------------------------------------- start-up on a GPU node

def test_two_ranks_on_one_gpu_stop_with_one_error_line(tiny_data, tmp_path):
    """More ranks on a node than GPUs ends the job at start-up with one error line, not
    NCCL's "Duplicate GPU" traceback on every rank."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    run = run_script("train.py", tiny(iters=1), data_dir=tiny_data, log_dir=tmp_path,
                     nproc=2, env_extra={"CUDA_VISIBLE_DEVICES": visible}, timeout=TIMEOUT)
    assert run.returncode == 1, run.output[-3000:]  # torchrun: a worker failed
    errors = [line for line in run.output.splitlines() if "error:" in line]
    assert len(errors) == 1, "\n".join(errors) or run.output[-3000:]
    assert "torchrun starts 2 ranks per node, which see 1 GPU" in errors[0], errors[0]
    assert "Duplicate GPU" not in run.output


def test_two_nodes_all_reduce_over_nccl_and_name_the_network(capsys):
    """Two nodes: NCCL all-reduces across them through this code's set-up, and the test
    names the network transport (plugin) NCCL used."""
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1") or 1)
    srun = shutil.which("srun")
    if nodes < 2 or srun is None:
        pytest.skip(f"needs srun in a SLURM allocation of >= 2 nodes (here {nodes} node(s), "
                    f"srun {'found' if srun else 'not on PATH'}); docs/gpu_self_test.md "
                    "has the sbatch line that runs tests/gpu/nccl_probe.py on 2 nodes")
    python = os.environ.get("PYTHON", sys.executable)  # the site's, inside its launcher
    probe = f"source export_DDP_vars.sh && exec {shlex.quote(python)} tests/gpu/nccl_probe.py"
    cmd = srun_on_two_nodes(srun, ["bash", "-c", probe], os.environ.get("SITE_LAUNCHER", ""))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), DIST_TIMEOUT_SEC="120")
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT)
    out = r.stdout + r.stderr
    ok = [line for line in out.splitlines() if line.startswith("nccl-probe ok:")]
    assert r.returncode == 0 and ok, out[-5000:]
    assert "on 2 nodes" in ok[0] and "network ?" not in ok[0], ok[0]
    if os.environ.get("SITE") == "perlmutter":  # the preset loads NCCL's libfabric plugin
        assert "network Socket" not in ok[0], f"NCCL fell back to TCP sockets: {ok[0]}"
    with capsys.disabled():
        print(f"\n{ok[0]}")
