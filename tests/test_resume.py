"""Resume is exact: an interrupted and resumed run ends where the uninterrupted run ends.

CPU, fp32, the tiny config (16 iterations = 2 epochs of 8, a checkpoint every 4):
  - train.py, one process: resumed from the checkpoint at iteration 8 (the last batch of
    epoch 1, whose end-of-epoch validation is still to do) inside a copy of the finished
    run's directory. Final parameters and optimizer state are bitwise equal, the logged
    losses equal, and TensorBoard holds each step once (purge_step drops the events the first
    run wrote after the checkpoint).
  - train_mp.py --tp 2: resumed with tp 2 from the checkpoint at iteration 12 (mid-epoch)
    copied to a fresh run directory: bitwise equal. Resumed with tp 1 (one process) and tp 4
    (four processes) from the same file: the same within rtol 1e-5 / atol 1e-6 (measured:
    max |difference| ~1e-8 after 4 steps); not bitwise, because the matmul shards, and with
    them the order of the floating-point sums, differ.
  - 2-rank DDP and the real signal path (SIGUSR1, torchrun's SIGTERM): test_preemption.py,
    which compares against the same reference runs (conftest's `reference_run`, one per
    session).
"""

from __future__ import annotations

import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import (
    REFERENCE_ARGS,
    TINY_ITERS,
    TrainRun,
    assert_completed,
    assert_same_state,
    epoch_losses,
    final_checkpoint,
    run_script,
)

pytestmark = pytest.mark.e2e

ITERS = TINY_ITERS
TIMEOUT = 240  # seconds per run; ~10-20 s each on an idle 2-core machine
# rtol/atol for resumes in another tensor-parallel layout.
LAYOUT_RTOL, LAYOUT_ATOL = 1e-5, 1e-6


def assert_close_state(resumed: dict, reference: dict) -> None:
    for key in ("iters", "epoch", "epoch_step"):
        assert resumed[key] == reference[key], key
    for name, tensor in reference["model"].items():
        torch.testing.assert_close(resumed["model"][name], tensor, rtol=LAYOUT_RTOL,
                                   atol=LAYOUT_ATOL, msg=lambda m, n=name: f"{n}: {m}")


def scalar_events(exp) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard scalars of a run directory, as EventAccumulator (TensorBoard) reads them:
    events of an earlier run at or after a resumed run's purge_step are dropped."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(exp / "logs"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


# ----------------------------------------------------------------- train.py, one process

def test_resume_without_a_checkpoint_starts_from_scratch(serial_reference):
    assert re.search(r"--resume: no checkpoint in \S+, starting from scratch",
                     serial_reference.stdout)
    assert "Initial val loss=" in serial_reference.stdout


def test_resume_at_an_epoch_end_is_exact_and_tensorboard_stays_one_curve(
        serial_reference, tiny_data, tmp_path):
    """Resume from iteration 8 (epoch 1's batches done, its validation not yet) inside a copy
    of the finished run's directory, which already holds TensorBoard events up to step 16."""
    ref_dir = serial_reference.exp_dir()
    copy = tmp_path / "logs"
    shutil.copytree(ref_dir, copy / "tiny" / "1CPU" / "00")
    ckpt8 = copy / "tiny" / "1CPU" / "00" / "checkpoints" / "ckpt_00000008.pt"
    run = run_script("train.py", [*REFERENCE_ARGS[:-1], f"--resume={ckpt8}"], data_dir=tiny_data,
                     log_dir=copy, timeout=TIMEOUT)
    assert_completed(run, ITERS)
    assert f"Resumed from {ckpt8}: iteration 8, epoch 1, 8 batches into it" in run.stdout
    assert "Initial val loss" not in run.stdout
    # The copied checkpoints after 8 belong to the abandoned timeline: set aside, not used.
    (aside,) = ckpt8.parent.glob("superseded-*")
    assert sorted(p.name for p in aside.iterdir()) == ["ckpt_00000012.pt", "ckpt_00000016.pt"]

    assert_same_state(final_checkpoint(run.exp_dir()), final_checkpoint(ref_dir))
    # The resumed run logs epoch 1's end (from the restored loss sum) and epoch 2: the same
    # numbers as the uninterrupted run.
    assert epoch_losses(run.stdout) == epoch_losses(serial_reference.stdout)

    resumed, reference = scalar_events(run.exp_dir()), scalar_events(ref_dir)
    for tag in ("Loss/train", "Loss/valid", "Learning Rate", "RMSE(u10m)/valid"):
        steps = [step for step, _ in resumed[tag]]
        assert steps == sorted(set(steps)), f"{tag}: repeated steps {steps}"
        assert resumed[tag] == reference[tag], tag
    assert [step for step, _ in resumed["Loss/train"]] == [0, 8, 16]


# ----------------------------------------------------------------- train_mp.py, other layouts

MP_ARGS = ("--config=tiny", f"--num_iters={ITERS}", "--checkpoint_interval=4")


@pytest.fixture(scope="module")
def mp_runs(reference_run, tiny_data, tmp_path_factory) -> dict[str, TrainRun]:
    """The uninterrupted tp=2 run, then three resumes from its iteration-12 checkpoint, run
    side by side: tp=2 from a copy in a fresh run directory (`--resume`, auto), tp=1 and
    tp=4 from the file itself (their run directories differ: <world size>CPU)."""
    ref = reference_run("train_mp.py", [*MP_ARGS, "--tp=2"], nproc=2)
    ckpt12 = ref.exp_dir("tiny", 2) / "checkpoints" / "ckpt_00000012.pt"
    assert ckpt12.is_file(), sorted(p.name for p in ckpt12.parent.iterdir())
    fresh = tmp_path_factory.mktemp("tp2_resume")  # a copy of the run, under its own name
    copy = fresh / "tiny" / "2CPU" / ref.exp_dir("tiny", 2).name / "checkpoints"
    copy.mkdir(parents=True)
    shutil.copy(ckpt12, copy)
    jobs = {
        "tp2": ([*MP_ARGS, "--tp=2", "--resume"], 2, fresh),
        "tp1": ([*MP_ARGS, "--tp=1", f"--resume={ckpt12}"], None,
                tmp_path_factory.mktemp("tp1_resume")),
        "tp4": ([*MP_ARGS, "--tp=4", f"--resume={ckpt12}"], 4,
                tmp_path_factory.mktemp("tp4_resume")),
    }
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(run_script, "train_mp.py", args, data_dir=tiny_data,
                                     log_dir=log_dir, nproc=nproc, timeout=TIMEOUT)
                   for name, (args, nproc, log_dir) in jobs.items()}
        runs = {name: f.result() for name, f in futures.items()}
    runs["reference"] = ref
    return runs


def _resumed_from_12(run: TrainRun) -> None:
    assert_completed(run, ITERS)
    assert re.search(r"Resumed from \S+ckpt_00000012\.pt: iteration 12, epoch 2, "
                     r"4 batches into it", run.stdout), run.stdout[-3000:]


def test_tensor_parallel_resume_in_the_same_layout_is_exact(mp_runs):
    run, ref = mp_runs["tp2"], mp_runs["reference"]
    _resumed_from_12(run)
    assert "Layout: DP = 1, TP = 2" in run.stdout
    assert_same_state(final_checkpoint(run.exp_dir("tiny", 2)),
                      final_checkpoint(ref.exp_dir("tiny", 2)))
    assert epoch_losses(run.stdout) == epoch_losses(ref.stdout)[1:]  # epoch 2


@pytest.mark.parametrize("tp, world", [(1, 1), (4, 4)])
def test_a_tensor_parallel_checkpoint_resumes_in_another_layout(mp_runs, tp, world):
    run, ref = mp_runs[f"tp{tp}"], mp_runs["reference"]
    _resumed_from_12(run)
    assert f"Layout: DP = 1, TP = {tp}" in run.stdout
    assert_close_state(final_checkpoint(run.exp_dir("tiny", world)),
                       final_checkpoint(ref.exp_dir("tiny", 2)))
    # The epoch-2 average includes the 4 losses before the checkpoint (saved by tp 2).
    (epoch, train, val), = epoch_losses(run.stdout)
    (ref_epoch, ref_train, ref_val), = epoch_losses(ref.stdout)[1:]
    assert epoch == ref_epoch == "2"
    assert float(train) == pytest.approx(float(ref_train), rel=1e-5)
    assert float(val) == pytest.approx(float(ref_val), rel=1e-5)
