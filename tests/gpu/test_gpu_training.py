"""GPU self-test, training: the train scripts run as subprocesses on this node's GPUs and
their logged losses and saved checkpoints are compared (bounds in gpu_utils.py).

  - train_mp_graphs.py (step captured in a CUDA graph, then replayed) trains like
    train_mp.py's eager step: same seed, same tiny config, fp32;
  - train.py with DDP over NCCL on every visible GPU trains like one GPU, also with fused
    Adam and torch.compile;
  - fp16 (with the GradScaler) and bf16 autocast train without NaN/inf, and learn;
  - an ensemble's noise, drawn on the CPU each step, reaches the GPU without a stream sync.
The model-parallel layouts on NCCL are in test_gpu_parallel.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_utils import (
    FP32_ENV,
    assert_finite_and_learning,
    assert_same_training,
    gpu_run,
    losses,
    need_gpus,
    require_cuda,  # noqa: F401  (fixture used through pytestmark)
)

from networks.ensemble import TRAINING, Members

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("require_cuda")]

TINY_TRAIN_SAMPLES = 32  # the tiny config's limit_nsamples
ITERS = 16               # two epochs of global batch 4


def tiny(iters: int = ITERS, *flags: str) -> list[str]:
    return ["--config=tiny", f"--num_iters={iters}", *flags]


def test_cuda_graph_replays_train_like_eager_steps(tiny_data, tmp_path_factory):
    """One GPU: a captured step replayed 13 times trains like the eager step (fp32).

    Capture after 3 eager warm-up steps, then 13 replays. A graph that replayed stale
    inputs, kept accumulating gradients, or froze the learning rate would leave the eager
    curve within a step or two."""
    eager = gpu_run("train_mp.py", tiny(), tiny_data, tmp_path_factory.mktemp("eager"),
                    env=FP32_ENV)
    graphs = gpu_run("train_mp_graphs.py", tiny(ITERS, "--graph_warmup=3"), tiny_data,
                     tmp_path_factory.mktemp("graphs"), env=FP32_ENV)
    assert "Capturing the training step in a CUDA graph after 3 warm-up steps" in \
        graphs.output, graphs.output[-3000:]
    assert "CUDA graphs need a GPU" not in graphs.output
    # step 2 is a replay, which allocates nothing: its memory line is the eager warm-up's
    assert "Memory of step 2 (a replay allocates nothing: the last eager warm-up step " \
        "before capture, its own peak): " in graphs.stdout, graphs.stdout[-3000:]
    assert "GB in the graph's pool" in graphs.stdout
    assert_same_training(graphs, eager, "tiny", (1, 1), ITERS)


@pytest.mark.parametrize("flags", [(), ("--enable_fused", "--enable_jit")],
                         ids=["adam", "fused_adam_compiled"])
def test_nccl_ddp_on_every_visible_gpu_trains_like_one_gpu(tiny_data, tmp_path_factory, flags):
    """DDP over NCCL on every GPU of the node (plain, and with fused Adam and torch.compile,
    whose DDP graph is split at the gradient buckets) trains like one GPU (fp32)."""
    n = need_gpus(2)
    if n > TINY_TRAIN_SAMPLES // 2:
        pytest.skip(f"{n} GPUs: more than the tiny data set can feed two steps per epoch")
    batch = n * math.ceil(4 / n)  # the global batch: divisible by n, at least 4
    iters = 2 * (TINY_TRAIN_SAMPLES // batch)  # two epochs
    one = gpu_run("train.py", tiny(iters, f"--local_batch_size={batch}", *flags), tiny_data,
                  tmp_path_factory.mktemp("one_gpu"), env=FP32_ENV)
    ddp = gpu_run("train.py", tiny(iters, f"--local_batch_size={batch // n}", *flags),
                  tiny_data, tmp_path_factory.mktemp("ddp"), nproc=n, env=FP32_ENV)
    assert f"world size {n} (env launcher), global batch {batch}, local batch {batch // n}" \
        in ddp.stdout, ddp.stdout[-3000:]
    assert_same_training(ddp, one, "tiny", (n, 1), iters)


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_mixed_precision_trains_without_nan(tiny_data, tmp_path, amp):
    """fp16 (with loss scaling) and bf16 autocast train on one GPU without NaN/inf, and
    learn."""
    import torch

    if amp == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name()} has no bf16")
    run = gpu_run("train.py", tiny(32, f"--amp_mode={amp}"), tiny_data, tmp_path)
    assert f"amp_mode: {amp}" in run.stdout
    assert "NaN/inf" not in run.output
    assert_finite_and_learning(run)
    assert len(losses(run)["train"]) == 4


def test_ensemble_noise_reaches_the_gpu_without_a_stream_sync():
    """The members' noise is drawn with numpy before every step (networks/ensemble.py): into
    page-locked memory, copied without blocking, so the step's queue never waits for it
    (torch.cuda's sync debug mode raises on a synchronising call); the values are the CPU's."""
    members = Members(size=4, first=0, count=4, noise_channels=4, grid=(45, 90),
                      rows=slice(0, 45), cols=slice(0, 90), seed=0)
    want = members.noise(TRAINING, 3, [0, 1], steps=2)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = members.noise(TRAINING, 3, [0, 1], steps=2, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), want)
