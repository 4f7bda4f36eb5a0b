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
  parameters agree to ~1e-7 absolute (measured: <= 1.2e-7). The tolerances below leave two
  orders of magnitude of room for other CPUs, and stay far below what a real bug changes:
  a wrong sample or a skipped all-reduce moves a parameter by ~lr = 1e-3 per step.
* Adam is invariant to the scale of the gradient, so parameters alone would not notice DDP
  summing instead of averaging. Adam's first moment (exp_avg, in the checkpoint) scales with
  the gradient: comparing it catches that.

The runs are real processes: `python -m torch.distributed.run --nproc_per_node 2 train.py`
on gloo; each is shared by the tests that read it (about a minute for the file).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, child_env, free_port, run_script

from utils.data.loader import get_data_loader

ITERS = 16               # two epochs of the tiny config: 32 samples / global batch 4
ITERS_PER_EPOCH = 8
GLOBAL_BATCH = 4
LOSS_RTOL = 1e-5         # printed losses have 6 decimals (~1e-6 relative at loss ~1)
PARAM_ATOL = 1e-5        # 1% of one Adam step (lr 1e-3); measured differences ~1e-7
MOMENT_RTOL = 1e-4       # Adam moments, relative to each tensor's largest entry; measured ~5e-7
TIMEOUT = 240            # seconds per training subprocess


# ----------------------------------------------------------------- helpers

def assert_completed(run, iters: int = ITERS) -> None:
    assert run.returncode == 0, f"exit {run.returncode}\n{run.output[-4000:]}"
    assert "Traceback" not in run.output, run.output[-4000:]
    assert f"Finished {iters} iterations" in run.stdout, run.stdout[-3000:]


def losses(run) -> dict[str, list[float]]:
    """The losses train.py logs: the untrained model's, then one train/val pair per epoch."""
    def values(label: str) -> list[float]:
        return [float(v) for v in re.findall(rf"{label}=([0-9.]+)", run.stdout)]

    return {"initial": values("Initial val loss"), "train": values("Avg train loss"),
            "val": values("Avg val loss")}


def final_checkpoint(run, world_size: int, iters: int = ITERS) -> dict:
    path = run.exp_dir("tiny", world_size) / "checkpoints" / f"ckpt_{iters:08d}.pt"
    assert path.is_file(), f"no final checkpoint {path}"
    return torch.load(path, map_location="cpu", weights_only=False)


def max_param_difference(a: dict, b: dict) -> float:
    assert a["model"].keys() == b["model"].keys()
    return max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])


def assert_same_training(run, ref, world_size: int, ref_world_size: int = 1) -> None:
    """Same logged losses and the same final parameters and Adam moments as `ref`."""
    got, want = losses(run), losses(ref)
    assert len(want["train"]) == len(want["val"]) == ITERS // ITERS_PER_EPOCH
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=LOSS_RTOL), (key, got, want)
    a, b = final_checkpoint(run, world_size), final_checkpoint(ref, ref_world_size)
    diff = max_param_difference(a, b)
    assert diff <= PARAM_ATOL, f"parameters differ by up to {diff:.3g}"
    for name, state in b["optimizer"]["state"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            want_m, got_m = state[moment], a["optimizer"]["state"][name][moment]
            scale = want_m.abs().max().item()
            err = (got_m - want_m).abs().max().item()
            assert err <= MOMENT_RTOL * scale, (name, moment, err, scale)


def train(tiny_data: Path, log_dir: Path, *flags: str, nproc: int | None = None,
          iters: int = ITERS):
    return run_script("train.py", ["--config=tiny", f"--num_iters={iters}", *flags],
                      data_dir=tiny_data, log_dir=log_dir, nproc=nproc, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def single(tiny_data, tmp_path_factory):
    """The reference: one process, global batch 4."""
    return train(tiny_data, tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module")
def ddp(tiny_data, tmp_path_factory):
    """Two DDP ranks, global batch 4 = 2 x local batch 2."""
    return train(tiny_data, tmp_path_factory.mktemp("ddp"), nproc=2)


# ----------------------------------------------------------------- the sampler

def step_batches(params, n_samples: int, replicas: int, epoch: int,
                 skip: int = 0) -> list[list[set[int]]]:
    """[step][rank] -> the set of sample indices rank `rank` trains on in that step."""
    params.limit_nsamples = n_samples
    params.local_batch_size = params.global_batch_size // replicas
    per_rank = []
    for rank in range(replicas):
        loader, _, sampler = get_data_loader(params, params.train_data_path,
                                             train=True,
                                             num_replicas=replicas, rank=rank)
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
    p.global_batch_size = global_batch
    for epoch in (1, 2):
        one = step_batches(p, n_samples, 1, epoch)
        many = step_batches(p, n_samples, replicas, epoch)
        assert len(one) == len(many) == n_samples // global_batch
        for i, (ref, ranks) in enumerate(zip(one, many, strict=True)):
            assert set().union(*ranks) == ref[0], f"epoch {epoch}, step {i}"
            assert sum(len(r) for r in ranks) == global_batch  # disjoint within the step


def test_ranks_are_disjoint_and_together_cover_the_epoch(tiny_params):
    p = tiny_params
    p.global_batch_size = GLOBAL_BATCH
    steps = step_batches(p, 32, 2, epoch=3)
    shards = [set().union(*(step[r] for step in steps)) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 16
    assert not shards[0] & shards[1]
    assert shards[0] | shards[1] == set(range(32))


def test_a_mid_epoch_resume_continues_with_the_same_global_batches(tiny_params):
    p = tiny_params
    p.global_batch_size = GLOBAL_BATCH
    full = step_batches(p, 32, 1, epoch=2)
    resumed = step_batches(p, 32, 2, epoch=2, skip=3)
    assert [set().union(*ranks) for ranks in resumed] == [ref[0] for ref in full[3:]]


def test_validation_shards_are_unshuffled_disjoint_and_cover_the_set(tiny_params):
    p = tiny_params
    p.limit_nsamples_val, p.local_batch_size = 8, 2
    shards = []
    for rank in (0, 1):
        _, _, sampler = get_data_loader(p, p.valid_data_path, train=False,
                                        num_replicas=2, rank=rank)
        shards.append(list(sampler))
    assert shards == [[0, 2, 4, 6], [1, 3, 5, 7]]


# ----------------------------------------------------------------- 2 ranks vs 1 process

def test_two_ddp_ranks_log_the_same_losses_as_one_process(single, ddp):
    assert_completed(single)
    assert_completed(ddp)
    assert "world size 2 (env launcher), global batch 4, local batch 2" in ddp.stdout
    assert f"{ITERS} iterations, {ITERS_PER_EPOCH} per epoch" in ddp.stdout
    assert "FutureWarning" not in ddp.output  # DDP built with PyTorch's current arguments
    got, want = losses(ddp), losses(single)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=LOSS_RTOL), (key, got, want)


def test_two_ddp_ranks_end_with_the_same_parameters_as_one_process(single, ddp):
    assert_completed(single)
    assert_completed(ddp)
    assert_same_training(ddp, single, world_size=2)


def test_bucket_size_and_broadcast_flags_do_not_change_the_training(tiny_data,
                                                                   tmp_path_factory, ddp):
    """A 1 MB bucket cap (the default is 25) and gradient_as_bucket_view without buffer
    broadcasts: both only change how DDP packs and schedules the same all-reduce."""
    run = train(tiny_data, tmp_path_factory.mktemp("ddp_flags"), "--bucket_cap_mb=1",
                "--disable_broadcast_buffers", nproc=2)
    assert_completed(run)
    assert "FutureWarning" not in run.output
    assert_same_training(run, ddp, world_size=2, ref_world_size=2)


def test_noddp_runs_and_the_ranks_then_train_on_their_shards_only(tiny_data,
                                                                  tmp_path_factory, ddp):
    run = train(tiny_data, tmp_path_factory.mktemp("noddp"), "--noddp", nproc=2)
    assert_completed(run)
    # Without the gradient all-reduce rank 0 followed its own half-batches: the model it
    # saved is not the data-parallel one (differences ~lr per step, not ~1e-7).
    diff = max_param_difference(final_checkpoint(run, 2), final_checkpoint(ddp, 2))
    assert diff > 100 * PARAM_ATOL, diff


def test_local_batch_size_redefines_the_global_batch(tiny_data, tmp_path_factory):
    run = train(tiny_data, tmp_path_factory.mktemp("local_bs"), "--local_batch_size=3",
                nproc=2, iters=5)
    assert_completed(run, iters=5)
    assert "global batch 6, local batch 3" in run.stdout
    assert "5 iterations, 5 per epoch" in run.stdout  # 16 samples per rank // 3
    assert "global_batch_size: 6" in run.stdout       # the logged configuration agrees


def test_global_batch_not_divisible_by_the_ranks_is_a_one_line_error(tiny_data, tmp_path):
    """2 ranks started the way SLURM or mpirun start them (no torchrun in between, so each
    rank's own exit code and stderr are visible) on a tiny config with global batch 3."""
    config = tmp_path / "odd_batch.yaml"
    config.write_text((REPO / "config" / "ViT.yaml").read_text()
                      + "\ntiny_bs3:\n  <<: *tiny\n  global_batch_size: 3\n")
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = child_env({"RANK": rank, "WORLD_SIZE": 2, "LOCAL_RANK": rank,
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                         "DATA_DIR": tiny_data, "LOG_DIR": tmp_path / "logs"})
        procs.append(subprocess.Popen(
            [sys.executable, "train.py", f"--yaml_config={config}", "--config=tiny_bs3"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    message = "error: global_batch_size 3 is not divisible by the data-parallel size 2"
    for rank, (code, out, err) in enumerate(results):
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2, (rank, code, out[-2000:], err[-2000:])
        assert lines == ([message] if rank == 0 else []), (rank, err)  # said once, by rank 0
