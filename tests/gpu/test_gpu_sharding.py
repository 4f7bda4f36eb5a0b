"""GPU self-test, FSDP, activation recomputation and torch.compile with them, on NCCL: what
the CPU proves on gloo (tests/test_fsdp.py, tests/test_memory_runs.py,
tests/test_compile_layouts.py, tests/test_fp16_overflow_scripts.py), again on GPUs. Training
runs use the tiny data set and config (16 x 32 grid, 16 steps), fp32 unless said
(tolerances: gpu_utils.py). Each test skips, with its reason, on a node with fewer GPUs.
"""

from __future__ import annotations

import pytest
from gpu_utils import (
    FP16_PARAM_RTOL,
    FP32_ENV,
    MIXED_LOSS_RTOL,
    OVERFLOW_STEP,
    assert_same_training,
    faulty_run,
    gpu_run,
    losses,
    need_gpus,
    require_cuda,  # noqa: F401  (fixture used through pytestmark)
    skipped,
)
from helpers import final_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("require_cuda")]

ITERS = 16


def tiny(*flags: str, iters: int = ITERS) -> list[str]:
    return ["--config=tiny", f"--num_iters={iters}", *flags]


@pytest.mark.parametrize("flags", [(), ("--activation_checkpointing=blocks",)],
                         ids=["fsdp", "fsdp_recompute"])
def test_fsdp_on_two_gpus_trains_like_ddp(tiny_data, tmp_path_factory, flags):
    """FSDP2 over dp 2 (NCCL's all-gathers and reduce-scatters; also with each block
    recomputed in backward) trains like DDP on the same 2 GPUs (fp32, GPU_FP32)."""
    need_gpus(2)
    ddp = gpu_run("train.py", tiny(), tiny_data, tmp_path_factory.mktemp("ddp"), nproc=2,
                  env=FP32_ENV)
    fsdp = gpu_run("train.py", tiny("--fsdp", *flags), tiny_data,
                   tmp_path_factory.mktemp("fsdp"), nproc=2, env=FP32_ENV)
    assert "Layout: DP = 2, FSDP" in fsdp.stdout, fsdp.stdout[-3000:]
    assert_same_training(fsdp, ddp, "tiny", (2, 2), ITERS)


def test_tp2_fsdp_on_four_gpus_trains_like_one_gpu(tiny_data, tmp_path_factory):
    """train_mp.py --tp 2 --fsdp on 4 GPUs (dp 2 x tp 2: FSDP cuts each tp shard again over
    dp) trains like train.py on one GPU (fp32, GPU_FP32)."""
    need_gpus(4)
    one = gpu_run("train.py", tiny(), tiny_data, tmp_path_factory.mktemp("one"),
                  env=FP32_ENV)
    run = gpu_run("train_mp.py", tiny("--tp=2", "--fsdp"), tiny_data,
                  tmp_path_factory.mktemp("tp2_fsdp"), nproc=4, env=FP32_ENV)
    assert "Layout: DP = 2, FSDP, TP = 2" in run.stdout, run.stdout[-3000:]
    assert_same_training(run, one, "tiny", (4, 1), ITERS)


def test_an_fp16_overflow_under_tp2_fsdp_is_skipped_by_every_gpu(tiny_data, tmp_path_factory):
    """fp16 under dp 2 x tp 2 with FSDP (fused Adam): an inf forced into one rank's slice of
    a gradient (dp rank 0, tp rank 1) makes all four skip that step, with the serial run's
    loss scales, skipped steps and (within FP16_PARAM_RTOL) parameters, over NCCL."""
    need_gpus(4)
    common = tiny("--amp_mode=fp16", "--enable_fused", iters=8)
    serial, serial_records = faulty_run(tmp_path_factory, tiny_data, "train.py", 0, common)
    run, records = faulty_run(tmp_path_factory, tiny_data, "train_mp.py", 1,
                              [*common, "--tp=2", "--fsdp"], nproc=4)
    assert "Layout: DP = 2, FSDP, TP = 2" in run.stdout, run.stdout[-3000:]
    want = skipped(serial_records[0])
    assert OVERFLOW_STEP in want, serial_records
    assert sorted(records) == [0, 1, 2, 3], records
    want_scales = [serial_records[0][s]["scale"] for s in sorted(serial_records[0])]
    for rank, mine in records.items():
        assert skipped(mine) == want, f"rank {rank} skipped {skipped(mine)}, serial {want}"
        assert [mine[s]["scale"] for s in sorted(mine)] == want_scales, (rank, mine)
    a = final_checkpoint(run.exp_dir("tiny", 4, kind="GPU"), 8)["model"]
    b = final_checkpoint(serial.exp_dir("tiny", 1, kind="GPU"), 8)["model"]
    for name, t in b.items():
        err = ((a[name].float() - t.float()).norm() / t.float().norm()).item()
        assert err <= FP16_PARAM_RTOL, f"{name}: {err:.2%} from the serial run's"


@pytest.mark.parametrize("flags", [("--fsdp",), ("--activation_checkpointing=blocks",)],
                         ids=["fsdp", "recompute"])
def test_compile_with_fsdp_and_with_recompute_at_dp2_trains_like_eager(tiny_data,
                                                                     tmp_path_factory, flags):
    """--enable_jit with FSDP and with recompute (DDP) on 2 GPUs: each block compiled on
    its own (Triton kernels), the run says so, and it trains like the same layout eagerly
    (fp32, GPU_FP32)."""
    need_gpus(2)
    eager = gpu_run("train.py", tiny(*flags), tiny_data, tmp_path_factory.mktemp("eager"),
                    nproc=2, env=FP32_ENV)
    compiled = gpu_run("train.py", tiny(*flags, "--enable_jit"), tiny_data,
                       tmp_path_factory.mktemp("compiled"), nproc=2, env=FP32_ENV)
    assert "torch.compile: block by block" in compiled.stdout, compiled.stdout[-3000:]
    assert "compiled no graph" not in compiled.output
    assert_same_training(compiled, eager, "tiny", (2, 2), ITERS)


def test_compiled_fsdp_in_bf16_trains_like_eager_fsdp(tiny_data, tmp_path_factory):
    """The same in the precision a GPU run picks (`amp_mode auto`: bf16): compiled FSDP
    logs eager FSDP's losses within MIXED_LOSS_RTOL."""
    import torch

    need_gpus(2)
    if not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name()} has no bf16")
    amp = "bf16"
    flags = tiny("--fsdp", f"--amp_mode={amp}")
    eager = gpu_run("train.py", flags, tiny_data, tmp_path_factory.mktemp("eager"), nproc=2)
    compiled = gpu_run("train.py", [*flags, "--enable_jit"], tiny_data,
                       tmp_path_factory.mktemp("compiled"), nproc=2)
    got, want = losses(compiled), losses(eager)
    assert want["train"] and len(got["train"]) == len(want["train"]), (got, want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=MIXED_LOSS_RTOL[amp]), (key, got, want)
