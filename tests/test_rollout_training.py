"""Training on rollouts (`rollout_steps` K) and fine-tuning from a checkpoint (`init_from`).

K > 1: the training set gives K targets per sample and the step's loss is the mean over k of
the loss of the model applied k times. K = 1 is the one-step training as it always was
(bitwise). `init_from` loads a checkpoint's weights into a run that starts at iteration 0.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
from helpers import (
    CONFIG_FILE,
    TINY_ITERS,
    TINY_SAMPLES_PER_YEAR,
    assert_close_rel,
    assert_completed,
    epoch_losses,
    layout_of,
    losses,
    one_line,
    run_distributed,
    run_script,
)

from data.dataset import ERA5Dataset
from networks.loss import RelativeL2Loss, l2_loss
from networks.vit import VisionTransformer
from training.profiling import StepProfiler
from training.step import Step, rollout_loss
from utils.config import read_config
from utils.errors import CheckpointError, ConfigError
from utils.precision import Precision

C = 20


def tiny_model(seed: int = 0) -> VisionTransformer:
    torch.manual_seed(seed)
    return VisionTransformer((16, 32), 4, C, C, 32, 2, 4)


def step_run(model: torch.nn.Module, tmp_path) -> SimpleNamespace:
    """The parts of a Training that the step uses: fp32, a serial layout, the relative L2
    loss, Adam, no loss scaling."""
    cpu = torch.device("cpu")
    layout = layout_of(read_config(CONFIG_FILE, "tiny", environ={}))  # serial
    return SimpleNamespace(ctx=SimpleNamespace(precision=Precision("none")), layout=layout,
                           model=model, loss=RelativeL2Loss(),
                           optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
                           scaler=torch.amp.GradScaler("cpu", enabled=False),
                           prof=StepProfiler(cpu, str(tmp_path), enabled=False))


# ----------------------------------------------------------------- the step

def test_one_step_targets_train_bitwise_as_the_plain_step(tmp_path):
    x, y = torch.randn(2, C, 16, 32), torch.randn(2, C, 16, 32)
    model = tiny_model()
    by_hand = copy.deepcopy(model)
    opt = torch.optim.Adam(by_hand.parameters(), lr=1e-3)
    run = step_run(model, tmp_path)
    for _ in range(2):
        loss = Step()(run, x, y)
        expected = l2_loss(by_hand(x), y)  # the one-step training as written before rollouts
        expected.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert torch.equal(loss, expected.detach())
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_two_step_loss_is_the_mean_of_the_hand_written_step_losses(tmp_path):
    x = torch.randn(2, C, 16, 32)
    tar = torch.randn(2, 2, C, 16, 32)  # (B, K, C, H, W)
    model = tiny_model()
    by_hand = copy.deepcopy(model)
    opt = torch.optim.Adam(by_hand.parameters(), lr=1e-3)
    loss = Step()(step_run(model, tmp_path), x, tar)
    first = by_hand(x)
    second = by_hand(first)  # the gradient flows through the first step's output
    expected = (l2_loss(first, tar[:, 0]) + l2_loss(second, tar[:, 1])) / 2
    expected.backward()
    opt.step()
    assert_close_rel(loss, expected.detach(), "two-step loss", rtol=1e-6)
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        assert_close_rel(p.detach(), q.detach(), name, rtol=1e-6, atol=1e-7)


def test_a_two_step_loss_trains_differently_from_the_one_step_loss(tmp_path):
    # The second step's loss contributes gradients: the update differs from the first
    # step's loss alone.
    x, tar = torch.randn(2, C, 16, 32), torch.randn(2, 2, C, 16, 32)
    one, two = tiny_model(), tiny_model()
    Step()(step_run(one, tmp_path), x, tar[:, 0])
    Step()(step_run(two, tmp_path), x, tar)
    assert any(not torch.equal(p, q) for p, q in zip(one.parameters(), two.parameters(),
                                                     strict=True))


# ----------------------------------------------------------------- the data

def test_k_targets_are_the_next_k_samples_and_each_file_loses_k_minus_1_samples(
        tiny_params, tiny_data):
    tiny_params = tiny_params.replace(limit_nsamples=None)
    one = ERA5Dataset(tiny_params, tiny_params.train_data_path, train=True)
    three = ERA5Dataset(tiny_params.replace(rollout_steps=3), tiny_params.train_data_path,
                        train=True)
    files = sorted((tiny_data / "train").glob("*.h5"))
    assert len(one) == len(files) * (TINY_SAMPLES_PER_YEAR - 1)
    assert len(three) == len(files) * (TINY_SAMPLES_PER_YEAR - 3)
    means = np.load(tiny_data / "stats" / "global_means.npy")[0]
    stds = np.load(tiny_data / "stats" / "global_stds.npy")[0]
    last_of_first_file = TINY_SAMPLES_PER_YEAR - 4
    for index, (path, i) in ((0, (files[0], 0)), (last_of_first_file, (files[0], 20)),
                             (last_of_first_file + 1, (files[1], 0))):
        inp, tar = three[index]
        with h5py.File(path, "r") as f:
            raw = f["fields"][i:i + 4]
        assert inp.shape == (C, 16, 32) and tar.shape == (3, C, 16, 32)
        np.testing.assert_allclose(inp.numpy(), (raw[0] - means) / stds, rtol=1e-6)
        np.testing.assert_allclose(tar.numpy(), (raw[1:] - means) / stds, rtol=1e-6)
        assert torch.equal(three[index][0], one[index if i == index else index + 2][0])


def test_validation_stays_one_step(tiny_params):
    val = ERA5Dataset(tiny_params.replace(rollout_steps=2), tiny_params.valid_data_path,
                      train=False)
    inp, tar = val[0]
    assert inp.shape == tar.shape == (C, 16, 32)


def test_dali_with_rollout_steps_is_a_one_line_config_error(tiny_data):
    from utils.config import read_config

    with pytest.raises(ConfigError) as err:
        read_config(CONFIG_FILE, "tiny", environ={"DATA_DIR": str(tiny_data)},
                    flags={"rollout_steps": 2, "data_loader_config": "dali"})
    assert "rollout_steps 2 needs data_loader_config pytorch" in one_line(err)


# ----------------------------------------------------------------- init_from

def saved_checkpoint(tmp_path, model: torch.nn.Module, params) -> str:
    from training.checkpoint import Checkpointer
    from training.progress import Progress

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ckpt = Checkpointer(str(tmp_path), params, model, opt,
                        torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0),
                        torch.amp.GradScaler("cpu", enabled=False), layout_of(params))
    return ckpt.save(Progress(iters=7, loss_sum=torch.zeros(())))


def test_init_from_copies_the_weights_of_a_checkpoint(tmp_path, tiny_params):
    from networks import build_model
    from training.checkpoint import load_weights

    trained, fresh = build_model(tiny_params), build_model(tiny_params)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.5)
    path = saved_checkpoint(tmp_path, trained, tiny_params)
    assert load_weights(path, tiny_params, fresh, layout_of(tiny_params)) == 7
    for (name, p), q in zip(fresh.named_parameters(), trained.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_init_from_a_bad_file_is_a_one_line_checkpoint_error(tmp_path, tiny_params):
    from networks import build_model
    from training.checkpoint import load_weights

    bad = tmp_path / "not_a_checkpoint.pt"
    bad.write_bytes(b"garbage")
    with pytest.raises(CheckpointError) as err:
        load_weights(str(bad), tiny_params, build_model(tiny_params), layout_of(tiny_params))
    assert str(bad) in one_line(err)
    path = saved_checkpoint(tmp_path, build_model(tiny_params), tiny_params)
    tiny_params = tiny_params.replace(embed_dim=64)  # another model
    with pytest.raises(CheckpointError) as err:
        load_weights(path, tiny_params, build_model(tiny_params), layout_of(tiny_params))
    assert "embed_dim=32" in one_line(err)


# ----------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def trained_checkpoint(tiny_data, tmp_path_factory):
    """A tiny run's final checkpoint and that run: what fine-tunes start from."""
    logs = tmp_path_factory.mktemp("logs")
    run = run_script("train.py", ["--config=tiny", "--num_iters=8"], data_dir=tiny_data,
                     log_dir=logs, timeout=240)
    assert_completed(run, 8)
    return next(logs.rglob("ckpt_00000008.pt")), run


def fine_tune(script, tiny_data, tmp_path_factory, ckpt, *flags, nproc=None):
    return run_script(script, ["--config=tiny", f"--num_iters={TINY_ITERS}",
                               "--rollout_steps=2", f"--init_from={ckpt}", *flags],
                      data_dir=tiny_data, log_dir=tmp_path_factory.mktemp("logs"),
                      nproc=nproc, timeout=240)


@pytest.mark.e2e
@pytest.mark.distributed
def test_tp2_fine_tunes_on_rollouts_like_train_py(trained_checkpoint, tiny_data,
                                                  tmp_path_factory):
    ckpt, trained = trained_checkpoint
    serial = fine_tune("train.py", tiny_data, tmp_path_factory, ckpt)
    tp2 = fine_tune("train_mp.py", tiny_data, tmp_path_factory, ckpt, "--tp=2", nproc=2)
    for run in (serial, tp2):
        assert_completed(run, TINY_ITERS)
        assert "rollout_steps: 2" in run.stdout
        assert "Fine-tuning: weights from" in run.stdout
        # Iteration 0 starts from the trained weights: its validation is the trained run's last.
        assert losses(run)["initial"] == [losses(trained)["val"][-1]]
    # fp32, tp 2 vs serial: the printed losses (6 decimals) agree to 1e-5 relative.
    a, b = losses(tp2), losses(serial)
    for key in ("train", "val"):
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, err_msg=key)
    assert [e[0] for e in epoch_losses(tp2.stdout)] == [e[0] for e in epoch_losses(serial.stdout)]


# ----------------------------------------------------------------- a rollout on tiles

def _spatial_rollout(h: int, w: int) -> None:
    """The AFNO maps a tile to a tile: a rollout on a mesh, with the loss of tiles, is the
    serial rollout's loss and gradient (max |err| <= 1e-5 x max |serial|: the tiles' sums
    add the same terms in another order)."""
    from sharded import gather_full_grads, scatter_image

    from distributed import comm
    from distributed.helpers import sync_shared_gradients
    from networks import build_model
    from networks.afno import AFNONet
    from utils.config import read_config

    torch.set_num_threads(1)
    comm.init(h=h, w=w)
    cfg = read_config(CONFIG_FILE, "tiny_afno", environ={}).replace(
        img_size=[28, 36], patch_size=4, n_in_channels=3, n_out_channels=3, embed_dim=16,
        depth=2, num_blocks=4, seed=3, h_parallel_size=h, w_parallel_size=w)
    spatial = layout_of(cfg)  # train_mp.py's layout: its layers, its sums over tiles
    serial = AFNONet(img_size=(28, 36), patch_size=4, in_chans=3, out_chans=3, embed_dim=16,
                     depth=2, num_blocks=4, seed=3)
    model = build_model(cfg, layers=spatial.layers)
    g = torch.Generator().manual_seed(0)
    x, tar = torch.randn(2, 3, 28, 36, generator=g), torch.randn(2, 2, 3, 28, 36, generator=g)
    expected = rollout_loss(serial, x, tar, l2_loss)
    expected.backward()
    tile = lambda t: scatter_image(t, serial.grid, 4)  # noqa: E731
    loss = rollout_loss(model, tile(x), tile(tar), RelativeL2Loss(spatial.sum_over_grid))
    loss.backward()
    sync_shared_gradients(model)
    where = f"h={h} w={w}"
    assert_close_rel(loss.detach(), expected.detach(), f"{where} two-step loss", 1e-5)
    grads = gather_full_grads(model)
    for name, p in serial.named_parameters():
        assert_close_rel(grads[name], p.grad, f"{where} grad of {name}", 1e-5)


@pytest.mark.distributed
def test_a_rollout_on_an_h2_mesh_has_the_serial_loss_and_gradients() -> None:
    run_distributed(_spatial_rollout, 2, 2, 1)


@pytest.mark.e2e
def test_init_from_a_missing_checkpoint_stops_train_py_with_one_error_line(tiny_data,
                                                                          tmp_path_factory):
    missing = tmp_path_factory.mktemp("nothing") / "ckpt_00000008.pt"
    run = run_script("train.py", ["--config=tiny", f"--init_from={missing}"],
                     data_dir=tiny_data, log_dir=tmp_path_factory.mktemp("logs"), timeout=120)
    assert run.returncode == 2, run.output[-3000:]
    assert "Traceback" not in run.output, run.output[-3000:]
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"checkpoint {missing} not found" in errors[0], run.stderr
