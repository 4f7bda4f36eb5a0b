"""Data parallelism: train.py on 2 DDP ranks is the same training as on 1 process.

Why it is the same, and why only up to rounding:

* Data. For each epoch every rank draws the same permutation (seeded with seed + epoch), and
  rank r of R takes positions r, r + R, r + 2R, ... of it. With local batch b = B / R, local
  batch i of rank r holds positions R*b*i + r + R*j (j < b), so the R local batches of global
  step i together hold positions B*i ... B*(i+1) - 1: exactly the samples of the single
  process's batch i, only interleaved differently between the ranks. Dropping the last partial
  batch also agrees: floor(floor(N / R) / b) == floor(N / B). The first tests check this on
  the real sampler, with and without a mid-epoch resume (`set_epoch(epoch, skip_batches)`).
* Gradients. The loss is a mean of per-sample terms; DDP averages the R ranks' half-batch
  mean gradients, which is the full-batch mean gradient with the additions done in another
  order. In fp32 that changes the last bits (~1e-7 relative per step).
* So the logged losses agree to the 6 printed digits, and after 16 Adam steps (lr 1e-3) the
  parameters agree to ~1e-7 absolute (measured: <= 1.2e-7). The tolerances (helpers.CPU_FP32)
  leave two orders of magnitude of room for other CPUs, and stay far below what a real bug
  changes: a wrong sample or a skipped all-reduce moves a parameter by ~lr = 1e-3 per step.
* Adam is invariant to the scale of the gradient, so parameters alone would not notice DDP
  summing instead of averaging. Adam's first moment (exp_avg, in the checkpoint) scales with
  the gradient: comparing it catches that.

The runs are real processes: `python -m torch.distributed.run --nproc_per_node 2 train.py`
on gloo; each is shared by the tests that read it (about a minute for the file). A global
batch the ranks cannot divide is one of test_errors.py's bad inputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import (
    CPU_FP32,
    TINY_ITERS,
    TINY_ITERS_PER_EPOCH,
    assert_completed,
    assert_same_training,
    final_checkpoint,
    losses,
    max_param_difference,
    run_script,
)

from data.loader import get_data_loader

ITERS = TINY_ITERS       # two epochs of the tiny config: 32 samples / global batch 4
GLOBAL_BATCH = 4
TIMEOUT = 240            # seconds per training subprocess


def train(tiny_data: Path, log_dir: Path, *flags: str, nproc: int | None = None,
          iters: int = ITERS):
    return run_script("train.py", ["--config=tiny", f"--num_iters={iters}", *flags],
                      data_dir=tiny_data, log_dir=log_dir, nproc=nproc, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ddp(tiny_data, tmp_path_factory):
    """Two DDP ranks, global batch 4 = 2 x local batch 2."""
    return train(tiny_data, tmp_path_factory.mktemp("ddp"), nproc=2)


# ----------------------------------------------------------------- the sampler

def step_batches(params, n_samples: int, replicas: int, epoch: int,
                 skip: int = 0) -> list[list[set[int]]]:
    """[step][rank] -> the set of sample indices rank `rank` trains on in that step."""
    params = params.replace(limit_nsamples=n_samples)
    params = params.replace(local_batch_size=params.global_batch_size // replicas)
    per_rank = []
    for rank in range(replicas):
        loader, _, sampler = get_data_loader(params, params.train_data_path,
                                             train=True,
                                             num_replicas=replicas, rank=rank,
                                             batch_size=params.local_batch_size)
        sampler.set_epoch(epoch, skip_batches=skip)
        order, b = list(sampler), params.local_batch_size
        batches = [set(order[i:i + b]) for i in range(0, len(order) - b + 1, b)]
        assert len(batches) == len(loader)  # what the loader yields with drop_last
        per_rank.append(batches)
    assert len({len(batches) for batches in per_rank}) == 1, "ranks disagree on steps/epoch"
    return [list(step) for step in zip(*per_rank, strict=True)]


@pytest.mark.parametrize("n_samples, replicas, global_batch", [
    (32, 2, 4),   # the tiny config
    (30, 2, 4),   # the epoch's last partial batch is dropped
    (27, 3, 6),   # R does not divide N
    (32, 4, 8),
])
def test_each_global_step_holds_the_single_process_batch(tiny_params, n_samples, replicas,
                                                         global_batch):
    p = tiny_params
    p = p.replace(global_batch_size=global_batch)
    for epoch in (1, 2):
        one = step_batches(p, n_samples, 1, epoch)
        many = step_batches(p, n_samples, replicas, epoch)
        assert len(one) == len(many) == n_samples // global_batch
        for i, (ref, ranks) in enumerate(zip(one, many, strict=True)):
            assert set().union(*ranks) == ref[0], f"epoch {epoch}, step {i}"
            assert sum(len(r) for r in ranks) == global_batch  # disjoint within the step


def test_ranks_are_disjoint_and_together_cover_the_epoch(tiny_params):
    p = tiny_params
    p = p.replace(global_batch_size=GLOBAL_BATCH)
    steps = step_batches(p, 32, 2, epoch=3)
    shards = [set().union(*(step[r] for step in steps)) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 16
    assert not shards[0] & shards[1]
    assert shards[0] | shards[1] == set(range(32))


def test_a_mid_epoch_resume_continues_with_the_same_global_batches(tiny_params):
    p = tiny_params
    p = p.replace(global_batch_size=GLOBAL_BATCH)
    full = step_batches(p, 32, 1, epoch=2)
    resumed = step_batches(p, 32, 2, epoch=2, skip=3)
    assert [set().union(*ranks) for ranks in resumed] == [ref[0] for ref in full[3:]]


def test_validation_shards_are_unshuffled_disjoint_and_cover_the_set(tiny_params):
    p = tiny_params
    p = p.replace(limit_nsamples_val=8, local_batch_size=2)
    shards = []
    for rank in (0, 1):
        _, _, sampler = get_data_loader(p, p.valid_data_path, train=False,
                                        num_replicas=2, rank=rank, batch_size=p.local_batch_size)
        shards.append(list(sampler))
    assert shards == [[0, 2, 4, 6], [1, 3, 5, 7]]


# ----------------------------------------------------------------- 2 ranks vs 1 process
# `serial_reference` (conftest.py): train.py on one process, global batch 4, 16 iterations.

@pytest.mark.e2e
def test_two_ddp_ranks_log_the_same_losses_as_one_process(serial_reference, ddp):
    assert_completed(ddp, ITERS)
    assert "world size 2 (env launcher), global batch 4, local batch 2" in ddp.stdout
    assert f"{ITERS} iterations, {TINY_ITERS_PER_EPOCH} per epoch" in ddp.stdout
    assert "FutureWarning" not in ddp.output  # DDP built with PyTorch's current arguments
    got, want = losses(ddp), losses(serial_reference)
    assert len(want["train"]) == len(want["val"]) == ITERS // TINY_ITERS_PER_EPOCH
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=CPU_FP32.loss_rtol), (key, got, want)


@pytest.mark.e2e
def test_two_ddp_ranks_end_with_the_same_parameters_as_one_process(serial_reference, ddp):
    assert_completed(ddp, ITERS)
    assert_same_training(ddp, serial_reference, world_size=2)


@pytest.mark.e2e
def test_bucket_size_and_broadcast_flags_do_not_change_the_training(tiny_data,
                                                                   tmp_path_factory, ddp):
    """A 1 MB bucket cap (the default is 25) and gradient_as_bucket_view without buffer
    broadcasts: both only change how DDP packs and schedules the same all-reduce."""
    run = train(tiny_data, tmp_path_factory.mktemp("ddp_flags"), "--bucket_cap_mb=1",
                "--disable_broadcast_buffers", nproc=2)
    assert_completed(run, ITERS)
    assert "FutureWarning" not in run.output
    assert_same_training(run, ddp, world_size=2, ref_world_size=2)


@pytest.mark.e2e
def test_noddp_runs_and_the_ranks_then_train_on_their_shards_only(tiny_data,
                                                                  tmp_path_factory, ddp):
    run = train(tiny_data, tmp_path_factory.mktemp("noddp"), "--noddp", nproc=2)
    assert_completed(run, ITERS)
    # Without the gradient all-reduce rank 0 followed its own half-batches: the model it
    # saved is not the data-parallel one (differences ~lr per step, not ~1e-7).
    diff = max_param_difference(final_checkpoint(run.exp_dir("tiny", 2), ITERS),
                                final_checkpoint(ddp.exp_dir("tiny", 2), ITERS))
    assert diff > 100 * CPU_FP32.param_atol, diff


@pytest.mark.e2e
def test_local_batch_size_redefines_the_global_batch(tiny_data, tmp_path_factory):
    run = train(tiny_data, tmp_path_factory.mktemp("local_bs"), "--local_batch_size=3",
                nproc=2, iters=5)
    assert_completed(run, 5)
    assert "global batch 6, local batch 3" in run.stdout
    assert "5 iterations, 5 per epoch" in run.stdout  # 16 samples per rank // 3
    assert "local_batch_size: 3" in run.stdout        # the logged configuration agrees

