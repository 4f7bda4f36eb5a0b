"""`--fsdp` and `--activation_checkpointing blocks` end to end: the train scripts as a user
runs them (torchrun, gloo, CPU, fp32, the tiny config: 16 iterations, a checkpoint every 4).

  - train.py --fsdp on 2 ranks trains like train.py on 1 process (helpers.CPU_FP32) and is
    bit for bit DDP on 2 ranks (the reference the preemption tests use): with 2 ranks,
    DDP's (a / 2 + b / 2) and FSDP's reduce-scatter (a + b) / 2 are the same floating-point
    number (a sum of two is exact in either order, halving is exact), and Adam updates each
    element alone, whichever rank holds it;
  - train_mp.py --tp 2 --fsdp on 4 ranks (dp 2 x tp 2) trains like train.py;
  - a run saved under FSDP resumes without it and one saved by DDP resumes under FSDP:
    both end bitwise where the uninterrupted runs end (same 2 ranks, so same numbers);
  - train.py --activation_checkpointing blocks on 2 DDP ranks, and with --fsdp, ends
    bitwise where DDP without it ends;
  - train_mp.py --cp 2 --activation_checkpointing blocks --enable_jit (the recompute
    compiled) trains like train.py;
  - train_mp_graphs.py refuses --fsdp and --activation_checkpointing in one line each.
fp16 with an overflow on one rank under FSDP: tests/test_fp16_overflow_scripts.py.
"""

from __future__ import annotations

import shutil

import pytest
from helpers import (
    REFERENCE_ARGS,
    TINY_ITERS,
    assert_completed,
    assert_one_error_line,
    assert_same_state,
    assert_same_training,
    epoch_losses,
    final_checkpoint,
    run_script,
)

pytestmark = pytest.mark.e2e

ITERS = TINY_ITERS
TIMEOUT = 300


@pytest.fixture(scope="module")
def fsdp2(reference_run):
    """train.py --fsdp on 2 ranks, with the reference runs' flags."""
    return reference_run("train.py", [*REFERENCE_ARGS, "--fsdp"], nproc=2)


@pytest.fixture(scope="module")
def ddp2(reference_run):
    """train.py on 2 DDP ranks (shared with tests/test_preemption.py)."""
    return reference_run("train.py", nproc=2)


def test_fsdp_on_two_ranks_trains_like_one_process(serial_reference, fsdp2):
    assert_completed(fsdp2, ITERS)
    assert "Layout: DP = 2, FSDP, TP = 1" in fsdp2.stdout
    assert_same_training(fsdp2, serial_reference, world_size=2)


def test_fsdp_on_two_ranks_is_bitwise_ddp_on_two_ranks(fsdp2, ddp2):
    assert_same_state(final_checkpoint(fsdp2.exp_dir("tiny", 2), ITERS),
                      final_checkpoint(ddp2.exp_dir("tiny", 2), ITERS))
    assert epoch_losses(fsdp2.stdout) == epoch_losses(ddp2.stdout)


def test_fsdp_with_tp2_on_four_ranks_trains_like_train_py(serial_reference, tiny_data,
                                                         tmp_path):
    run = run_script("train_mp.py", ["--config=tiny", f"--num_iters={ITERS}", "--tp=2",
                                     "--fsdp"], data_dir=tiny_data, log_dir=tmp_path,
                     nproc=4, timeout=TIMEOUT)
    assert_completed(run, ITERS)
    assert "Layout: DP = 2, FSDP, TP = 2" in run.stdout
    assert_same_training(run, serial_reference, world_size=4)


def _resume(tiny_data, tmp_path, source, iteration: int, *flags: str):
    """train.py on 2 ranks resumed from `source`'s checkpoint at `iteration`, copied into a
    fresh run directory."""
    ckpt = source.exp_dir("tiny", 2) / "checkpoints" / f"ckpt_{iteration:08d}.pt"
    copy = tmp_path / "tiny" / "2CPU" / "resumed" / "checkpoints"
    copy.mkdir(parents=True)
    shutil.copy(ckpt, copy)
    run = run_script("train.py", [*REFERENCE_ARGS, "--run_num=resumed", *flags],
                     data_dir=tiny_data, log_dir=tmp_path, nproc=2, timeout=TIMEOUT)
    assert_completed(run, ITERS)
    assert f"iteration {iteration}" in run.stdout
    return run


def test_a_checkpoint_saved_under_fsdp_resumes_without_it_bitwise(fsdp2, ddp2, tiny_data,
                                                                  tmp_path):
    run = _resume(tiny_data, tmp_path, fsdp2, 8)  # DDP from here on
    assert "Layout: DP = 2, TP = 1" in run.stdout
    assert_same_state(final_checkpoint(run.exp_dir("tiny", 2, run_num="resumed"), ITERS),
                      final_checkpoint(ddp2.exp_dir("tiny", 2), ITERS))


def test_a_ddp_checkpoint_resumes_under_fsdp_bitwise(ddp2, fsdp2, tiny_data, tmp_path):
    run = _resume(tiny_data, tmp_path, ddp2, 12, "--fsdp")
    assert "Layout: DP = 2, FSDP" in run.stdout
    assert_same_state(final_checkpoint(run.exp_dir("tiny", 2, run_num="resumed"), ITERS),
                      final_checkpoint(fsdp2.exp_dir("tiny", 2), ITERS))


def test_recompute_under_ddp_and_under_fsdp_is_bitwise_the_run_without_it(ddp2, tiny_data,
                                                                          tmp_path):
    """Recompute reruns each block's forward exactly, so DDP's gradients (and FSDP's, bitwise
    DDP's on 2 ranks) are unchanged: the same checkpoint, bit for bit, as DDP without it."""
    for i, flags in enumerate((["--activation_checkpointing=blocks"],
                               ["--activation_checkpointing=blocks", "--fsdp"])):
        run = run_script("train.py", [*REFERENCE_ARGS, f"--run_num=recompute{i}", *flags],
                         data_dir=tiny_data, log_dir=tmp_path, nproc=2, timeout=TIMEOUT)
        assert_completed(run, ITERS)
        assert_same_state(final_checkpoint(run.exp_dir("tiny", 2, run_num=f"recompute{i}"),
                                           ITERS),
                          final_checkpoint(ddp2.exp_dir("tiny", 2), ITERS))
        assert epoch_losses(run.stdout) == epoch_losses(ddp2.stdout), flags


def test_compiled_recompute_with_cp2_trains_like_train_py(serial_reference, tiny_data,
                                                          tmp_path):
    run = run_script("train_mp.py", ["--config=tiny", f"--num_iters={ITERS}", "--cp=2",
                                     "--activation_checkpointing=blocks", "--enable_jit"],
                     data_dir=tiny_data, log_dir=tmp_path, nproc=2, timeout=600)
    assert_completed(run, ITERS)
    assert_same_training(run, serial_reference, world_size=2)


@pytest.mark.parametrize("flag, words", [
    ("--fsdp", ["--fsdp", "train_mp_graphs.py", "train_mp.py"]),
    ("--activation_checkpointing=blocks", ["--activation_checkpointing blocks",
                                           "CUDA RNG", "train_mp.py"])])
def test_the_graphs_script_refuses_what_one_graph_cannot_hold(tiny_data, tmp_path, flag,
                                                              words):
    run = run_script("train_mp_graphs.py", ["--config=tiny", flag], data_dir=tiny_data,
                     log_dir=tmp_path, timeout=120)
    assert_one_error_line(run, words)
