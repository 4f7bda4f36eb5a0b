"""Spatial parallelism end to end: train_mp.py trains the AFNO on an h x w mesh (each rank
reads, trains on and scores its tile of the grid) exactly as train.py trains it on one
process, and its checkpoints resume on one process.

Why the curves agree: the spatial model initialises every parameter to the serial model's
numbers (networks.blocks.init_weights keeps each rank's part), every rank of a mesh reads the
same samples (data-parallel sharding is over dp only), the loss of tiles is summed over the
mesh before the ratio of norms is taken, and the replicated parameters' partial gradients
are summed over h and w. What differs is where sums happen (tiles, all-to-all transposes of
the FFT), which changes the last bits in fp32. Tolerances are tests/test_ddp.py's: printed
losses to 1e-5 relative, parameters after 16 Adam steps to 1e-5 absolute, Adam moments to
1e-4 of each tensor's largest entry.

Runs (tiny_afno: 16 x 32 grid, 4 x 8 tokens, 16 steps = 2 epochs, a checkpoint every 4):
  serial      python train.py
  h2 x w2     torchrun --nproc_per_node 4 train_mp.py --h_parallel_size 2 --w_parallel_size 2
  h2 x dp2    torchrun --nproc_per_node 4 train_mp.py --h_parallel_size 2   (DDP on top)
  resumed     python train.py --resume <h2 x w2's checkpoint at iteration 12, mid-epoch>
Each takes 5-25 s on 2 idle cores.
"""

from __future__ import annotations

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

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

CONFIG = "tiny_afno"
TIMEOUT = 240
ARGS = (f"--config={CONFIG}", f"--num_iters={TINY_ITERS}", "--checkpoint_interval=4")


def run(script: str, tiny_data, tmp_path_factory, *flags: str, nproc: int | None = None):
    return run_script(script, [*ARGS, *flags], data_dir=tiny_data,
                      log_dir=tmp_path_factory.mktemp("logs"), nproc=nproc, timeout=TIMEOUT)


def assert_same_as_serial(run, serial, world_size: int) -> None:
    """Same losses, final parameters and Adam moments as the serial run (CPU fp32)."""
    assert_same_training(run, serial, world_size, config=CONFIG)


@pytest.fixture(scope="module")
def serial(tiny_data, tmp_path_factory):
    """train.py on one process: the reference."""
    return run("train.py", tiny_data, tmp_path_factory)


@pytest.fixture(scope="module")
def mesh(tiny_data, tmp_path_factory):
    return run("train_mp.py", tiny_data, tmp_path_factory, "--h_parallel_size=2",
               "--w_parallel_size=2", nproc=4)


def test_h2_w2_mesh_trains_like_train_py(serial, mesh):
    assert_completed(serial)
    assert_completed(mesh)
    assert "Layout: DP = 1, TP = 1, CP = 1, H = 2, W = 2 (order tp-cp-h-w-ens-dp)" in mesh.stdout
    want = losses(serial)
    assert len(want["train"]) == len(want["val"]) == TINY_ITERS // TINY_ITERS_PER_EPOCH
    for label in ("RMSE(u10m) model", "persistence", "ACC(u10m)"):  # the scores of tiles
        assert serial.stdout.count(label) == mesh.stdout.count(label) > 0, label
    assert_same_as_serial(mesh, serial, 4)


def test_data_parallel_on_top_of_the_mesh_trains_like_train_py(serial, tiny_data,
                                                               tmp_path_factory):
    """h 2 x dp 2 on 4 ranks: each dp replica reads half of every global batch, each of its
    h ranks the top or bottom half of those samples; DDP averages over dp only."""
    both = run("train_mp.py", tiny_data, tmp_path_factory, "--h_parallel_size=2", nproc=4)
    assert_completed(both)
    assert "Layout: DP = 2, TP = 1, CP = 1, H = 2, W = 1" in both.stdout
    assert "global batch 4, local batch 2" in both.stdout
    assert_same_as_serial(both, serial, 4)


def test_a_mesh_checkpoint_resumes_on_one_process_as_if_never_interrupted(
        serial, mesh, tiny_data, tmp_path_factory):
    """The 2 x 2 run's checkpoint at iteration 12 (mid-epoch 2) holds full tensors: train.py
    resumes it and ends where the uninterrupted serial run ends."""
    assert_completed(mesh)
    ckpt = mesh.exp_dir(CONFIG, 4) / "checkpoints" / "ckpt_00000012.pt"
    resumed = run("train.py", tiny_data, tmp_path_factory, f"--resume={ckpt}")
    assert_completed(resumed)
    assert "Resumed from" in resumed.stdout and "iteration 12, epoch 2" in resumed.stdout
    got, want = losses(resumed), losses(serial)
    assert got["initial"] == [] and len(got["train"]) == len(got["val"]) == 1
    for key in ("train", "val"):
        assert got[key] == pytest.approx(want[key][-1:], rel=CPU_FP32.loss_rtol), key
    diff = max_param_difference(final_checkpoint(resumed.exp_dir(CONFIG), TINY_ITERS),
                                final_checkpoint(serial.exp_dir(CONFIG), TINY_ITERS))
    assert diff <= CPU_FP32.param_atol, f"parameters differ by up to {diff:.3g}"
