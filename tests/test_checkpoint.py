"""utils/checkpoint.py in one process: what a checkpoint holds, atomic saves (also when the
saving process is killed mid-write), keep-K, the one-line errors for corrupt or incompatible
files, no NaN ever saved, `--resume` resolution, and the NaN/inf loss guard of train().

The end-to-end resume runs (bitwise equality, other layouts, TensorBoard) are in
test_resume.py and test_preemption.py.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from bad_data import flip_tensor_byte
from helpers import REPO, child_env, layout_of, one_line

from networks.vit import vit_from_params
from training.checkpoint import (
    Checkpointer,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_weights,
    resolve_resume,
)
from training.guard import NonFiniteLoss
from training.progress import Progress
from training.run import build_optimizer, build_scheduler
from utils.precision import Precision

CPU = torch.device("cpu")


class Run:
    """The objects train() checkpoints, for the tiny model."""

    def __init__(self, params, exp_dir: Path, seed: int = 0):
        torch.manual_seed(seed)
        self.model = vit_from_params(params)
        self.optimizer = build_optimizer(params, self.model)
        self.scheduler = build_scheduler(params, self.optimizer)
        self.scaler = Precision(params.amp_mode).grad_scaler()
        self.ckpt = Checkpointer(str(exp_dir), params, self.model, self.optimizer,
                                 self.scheduler, self.scaler, layout_of(params))

    def steps(self, n: int) -> torch.Tensor:
        loss_sum = torch.zeros(())
        for _ in range(n):
            x = torch.randn(2, 20, 16, 32)
            loss = (self.model(x) - x).square().mean()
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            loss_sum += loss.detach()
        return loss_sum


@pytest.fixture
def params(tiny_params):
    return tiny_params.replace(checkpoint_keep=3)


# ----------------------------------------------------------------- contents and exactness

def test_a_checkpoint_restores_everything_a_run_needs(params, tmp_path):
    a = Run(params, tmp_path / "a")
    loss_sum = a.steps(3)
    path = a.ckpt.save(Progress(3, epoch=1, epoch_step=3, loss_sum=loss_sum, step_count=3))
    assert path == str(tmp_path / "a" / "checkpoints" / "ckpt_00000003.pt")
    # What the next draws would be: the restored run must make the same ones.
    expected = (torch.rand(4), np.random.rand(3), random.random())
    torch.manual_seed(123), np.random.seed(123), random.seed(123)  # scramble them

    b = Run(params, tmp_path / "b", seed=1)  # different initial weights
    state = b.ckpt.restore(path)
    assert (state.iters, state.epoch, state.epoch_step, state.step_count) == (3, 1, 3, 3)
    assert torch.equal(state.loss_sum, loss_sum)
    assert torch.equal(torch.rand(4), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and random.random() == expected[2]
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    for idx, st in sa["state"].items():
        for key, value in st.items():
            assert torch.equal(value, sb["state"][idx][key]), (idx, key)
    assert sa["param_groups"] == sb["param_groups"]
    assert b.scheduler.state_dict() == a.scheduler.state_dict()
    assert b.scaler.state_dict() == a.scaler.state_dict()
    # ... so both continue identically, bit for bit.
    torch.manual_seed(7)
    a.steps(2)
    torch.manual_seed(7)
    b.steps(2)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_a_tensor_learning_rate_is_filled_in_place(params, tmp_path):
    """train_mp_graphs.py keeps the lr in a tensor that its captured CUDA graph reads: a
    restore must write the saved lr into that tensor, not replace the tensor."""
    a = Run(params, tmp_path / "a")
    a.steps(3)
    path = a.ckpt.save(Progress(3, 1, 3))
    model = vit_from_params(params)
    optimizer = build_optimizer(params, model, capturable=True)
    lr = optimizer.param_groups[0]["lr"]
    assert torch.is_tensor(lr)
    Checkpointer(str(tmp_path / "b"), params, model, optimizer,
                 build_scheduler(params, optimizer), Precision(params.amp_mode).grad_scaler(),
                 layout_of(params)).restore(path)
    assert optimizer.param_groups[0]["lr"] is lr
    assert lr.item() == pytest.approx(a.optimizer.param_groups[0]["lr"], rel=1e-6)
    assert lr.item() != pytest.approx(params.lr)  # the schedule had moved it


def test_checkpoint_files_load_without_running_code(params, tmp_path):
    """weights_only=True: tensors and plain containers only (no pickled objects)."""
    path = Run(params, tmp_path).ckpt.save(Progress(1, 1, 1))
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["format"] == "era5-vit-checkpoint" and ckpt["config"]["embed_dim"] == 32
    assert ckpt["params"]["config"] == "tiny"


def test_only_the_last_k_are_kept(params, tmp_path):
    run = Run(params.replace(checkpoint_keep=2), tmp_path)
    for it in range(1, 6):
        run.ckpt.save(Progress(it, 1, it))
    assert [Path(p).name for p in list_checkpoints(str(tmp_path))] == \
        ["ckpt_00000004.pt", "ckpt_00000005.pt"]
    assert latest_checkpoint(str(tmp_path)).endswith("ckpt_00000005.pt")


def test_a_new_start_sets_aside_later_checkpoints_of_an_earlier_run(params, tmp_path):
    """Resuming from 4 (or starting afresh) in a directory that holds 8 and 12 of an earlier
    run: those move to checkpoints/superseded-*/, so keep-K cannot delete the new run's
    files in their favour and `--resume` cannot pick them up later."""
    run = Run(params, tmp_path)
    for it in (4, 8, 12):
        run.ckpt.save(Progress(it, 1, it))
    run.ckpt.start_at(4)
    assert [Path(p).name for p in list_checkpoints(str(tmp_path))] == ["ckpt_00000004.pt"]
    (aside,) = (tmp_path / "checkpoints").glob("superseded-*")
    assert sorted(p.name for p in aside.iterdir()) == ["ckpt_00000008.pt", "ckpt_00000012.pt"]
    run.ckpt.start_at(0)  # a fresh start: nothing of the earlier run stays in the way
    assert list_checkpoints(str(tmp_path)) == []


# ----------------------------------------------------------------- atomic saves

KILLED_SAVER = """
import pathlib, sys, time
import torch
from training.checkpoint import save_atomic

class Stall:  # pickled half-way through the save: the parent kills us here
    def __reduce__(self):
        pathlib.Path(sys.argv[2]).touch()
        time.sleep(120)
        return (int, (0,))

save_atomic({"weights": torch.ones(1 << 16), "stall": Stall()}, sys.argv[1])
"""


@pytest.mark.e2e  # a real saver process, killed
def test_killing_a_save_midway_damages_no_checkpoint(params, tmp_path):
    run = Run(params, tmp_path)
    old = run.ckpt.save(Progress(4, 1, 4))
    before = Path(old).read_bytes()
    ckdir = Path(old).parent
    for target in (old, str(ckdir / "ckpt_00000008.pt")):  # overwrite, and a new file
        ready = tmp_path / "ready"
        ready.unlink(missing_ok=True)
        child = subprocess.Popen([sys.executable, "-c", KILLED_SAVER, target, str(ready)],
                                 cwd=REPO, env=child_env())
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                assert child.poll() is None, f"saver exited early ({child.returncode})"
                assert time.monotonic() < deadline, "the saver never reached the save"
                time.sleep(0.05)
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait(timeout=30)
        assert list(ckdir.glob("*.tmp.*")), "the killed save left no partial file?"
        assert Path(old).read_bytes() == before
        assert list_checkpoints(str(tmp_path)) == [old]  # the partial file is never listed
        assert latest_checkpoint(str(tmp_path)) == old
        Run(params, tmp_path / "fresh").ckpt.restore(old)  # and it still loads
    run.ckpt.save(Progress(5, 1, 5))  # the next save clears what the killed ones left
    assert not list(ckdir.glob("*.tmp*"))


def test_a_failed_write_is_one_error_and_keeps_the_previous_file(params, tmp_path,
                                                                 monkeypatch):
    run = Run(params, tmp_path)
    old = run.ckpt.save(Progress(4, 1, 4))
    before = Path(old).read_bytes()

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError) as e:
        run.ckpt.save(Progress(8, 1, 8))
    assert "ckpt_00000008.pt" in one_line(e.value) and "No space left" in str(e.value)
    assert Path(old).read_bytes() == before
    assert list_checkpoints(str(tmp_path)) == [old]
    assert not list(Path(old).parent.glob("*.tmp*"))


def test_an_unwritable_checkpoint_directory_is_one_error(params, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    run = Run(params, blocker / "run")
    with pytest.raises(CheckpointError) as e:
        run.ckpt.save(Progress(1, 1, 1))
    assert str(blocker) in one_line(e.value)


def test_nan_parameters_are_never_saved(params, tmp_path):
    run = Run(params, tmp_path)
    good = run.ckpt.save(Progress(2, 1, 2))
    with torch.no_grad():
        next(run.model.parameters())[0] = float("nan")
    with pytest.raises(FloatingPointError) as e:
        run.ckpt.save(Progress(3, 1, 3))
    message = one_line(e.value)
    assert "iteration 3" in message and good in message  # names the checkpoint that is kept
    assert list_checkpoints(str(tmp_path)) == [good]


# ----------------------------------------------------------------- corrupt / incompatible

def _saved(params, tmp_path) -> str:
    run = Run(params, tmp_path / "src")
    run.steps(1)
    return run.ckpt.save(Progress(1, 1, 1))


def _edit(path: str, out: Path, change) -> None:
    ckpt = torch.load(path, weights_only=True)
    change(ckpt)
    torch.save(ckpt, out)


def _truncated(good: str, out: Path) -> None:
    out.write_bytes(Path(good).read_bytes()[:4000])


def _flipped_byte(good: str, out: Path) -> None:
    out.write_bytes(Path(good).read_bytes())
    flip_tensor_byte(out)


def _random_bytes(good: str, out: Path) -> None:
    out.write_bytes(os.urandom(5000))


def _empty(good: str, out: Path) -> None:
    out.write_bytes(b"")


def _missing(good: str, out: Path) -> None:
    pass


def _plain_state_dict(good: str, out: Path) -> None:
    torch.save({"w": torch.ones(2)}, out)


def _pickled_object(good: str, out: Path) -> None:
    torch.save({"format": "era5-vit-checkpoint", "obj": Path("x")}, out)


def _other_version(good: str, out: Path) -> None:
    _edit(good, out, lambda c: c.update(version=99))


def _no_optimizer(good: str, out: Path) -> None:
    _edit(good, out, lambda c: c.pop("optimizer"))


def _missing_tensor(good: str, out: Path) -> None:
    _edit(good, out, lambda c: c["model"].pop("head.weight"))


def _wrong_shape(good: str, out: Path) -> None:
    _edit(good, out, lambda c: c["model"].update({"head.bias": torch.zeros(3, 5)}))


# kind: (make the bad file from a good one, words the one-line error must contain)
CORRUPTIONS = {
    "truncated": (_truncated, ["unreadable", "truncated"]),
    "random_bytes": (_random_bytes, ["unreadable"]),
    "flipped_byte": (_flipped_byte, ["unreadable", "fails its CRC check"]),
    "empty": (_empty, ["unreadable", "0 bytes"]),
    "missing": (_missing, ["not found"]),
    "plain_state_dict": (_plain_state_dict, ["not a checkpoint of this project"]),
    "pickled_object": (_pickled_object, ["unreadable", "Unsupported global"]),
    "other_version": (_other_version, ["format version 99"]),
    "no_optimizer": (_no_optimizer, ["incomplete", "optimizer"]),
    "missing_tensor": (_missing_tensor, ["no tensor for parameter head.weight"]),
    "wrong_shape": (_wrong_shape, ["head.bias", "shape (3, 5)", "expects (320,)"]),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_corrupt_checkpoint_is_a_one_line_error_naming_the_file(kind, params, tmp_path):
    make, words = CORRUPTIONS[kind]
    bad = tmp_path / f"{kind}.pt"
    make(_saved(params, tmp_path), bad)
    bad = str(bad)
    with pytest.raises(CheckpointError) as e:
        Run(params, tmp_path / "resume").ckpt.restore(bad)
    message = one_line(e.value)
    assert bad in message, message
    for word in words:
        assert word in message, (word, message)


def test_a_checkpoint_of_another_model_config_names_the_mismatch(params, tmp_path):
    path = _saved(params, tmp_path)
    with pytest.raises(CheckpointError) as e:
        Run(params.replace(embed_dim=64), tmp_path / "resume").ckpt.restore(path)
    message = one_line(e.value)
    assert path in message and "embed_dim=32" in message and "embed_dim=64" in message


def _ensemble(params):
    return params.replace(loss="crps", ensemble_size=4)


def test_a_deterministic_checkpoint_starts_an_ensemble_only_as_a_fine_tune(params, tmp_path,
                                                                          caplog):
    """--resume refuses it in one line naming --init_from; init_from loads it (said in the
    log), and the ensemble then computes the deterministic model, whatever its noise."""
    path = _saved(params, tmp_path)
    ensemble = Run(_ensemble(params), tmp_path / "resume")
    with pytest.raises(CheckpointError) as e:
        ensemble.ckpt.restore(path)
    message = one_line(e.value)
    for word in (path, "deterministic model", "an ensemble of 4", f"--init_from {path}"):
        assert word in message, (word, message)
    with caplog.at_level(logging.INFO):
        load_weights(path, _ensemble(params), ensemble.model, layout_of(params))
    assert "Fine-tuning a deterministic model into an ensemble of 4" in caplog.text
    deterministic = vit_from_params(params)
    load_weights(path, params, deterministic, layout_of(params))
    x, noise = torch.randn(2, 20, 16, 32), torch.randn(2, 4, 4, 8)
    assert torch.equal(ensemble.model(x, noise), deterministic(x))


def test_an_ensemble_checkpoint_is_refused_by_a_deterministic_model(params, tmp_path):
    path = Run(_ensemble(params), tmp_path / "src").ckpt.save(Progress(1, 1, 1))
    for load in (lambda: Run(params, tmp_path / "resume").ckpt.restore(path),
                 lambda: load_weights(path, params, vit_from_params(params), layout_of(params))):
        with pytest.raises(CheckpointError) as e:
            load()
        message = one_line(e.value)
        assert path in message and "ensemble_size 4" in message, message
    # ... and resumes an ensemble of another size: its tensors are the same
    Run(_ensemble(params).replace(ensemble_size=2), tmp_path / "resume2").ckpt.restore(path)


# ----------------------------------------------------------------- --resume

def test_resume_resolution(params, tmp_path, monkeypatch, caplog):
    exp = str(tmp_path / "run")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    with caplog.at_level(logging.INFO):
        assert resolve_resume("auto", exp) is None
    assert "no checkpoint" in caplog.text and "starting from scratch" in caplog.text
    assert resolve_resume(None, exp) is None
    run = Run(params, tmp_path / "run")
    run.ckpt.save(Progress(4, 1, 4))
    newest = run.ckpt.save(Progress(8, 1, 8))
    assert resolve_resume("auto", exp) == newest
    assert resolve_resume("/some/file.pt", exp) == "/some/file.pt"
    # --requeue: a run that SLURM restarted resumes by itself; a first run does not.
    assert resolve_resume(None, exp, requeue=True) is None
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert resolve_resume(None, exp, requeue=True) == newest
    assert resolve_resume(None, exp, requeue=False) is None


@pytest.mark.parametrize("damage", [_truncated, _flipped_byte])
def test_resume_auto_skips_a_damaged_newest_checkpoint(params, tmp_path, monkeypatch, caplog,
                                                       damage):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    run = Run(params, tmp_path / "run")
    good = run.ckpt.save(Progress(4, 1, 4))
    newest = run.ckpt.save(Progress(8, 1, 8))
    damage(newest, tmp_path / "damaged.pt")
    os.replace(tmp_path / "damaged.pt", newest)
    with caplog.at_level(logging.WARNING):
        assert resolve_resume("auto", str(tmp_path / "run")) == good
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"skipping {newest}, it is damaged" in warnings[0]


def test_resume_auto_with_no_intact_checkpoint_is_one_error(params, tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    run = Run(params, tmp_path / "run")
    for iters in (4, 8):
        path = run.ckpt.save(Progress(iters, 1, iters))
        _truncated(path, Path(path))
    with pytest.raises(CheckpointError) as e:
        resolve_resume("auto", str(tmp_path / "run"))
    assert "none of the 2 checkpoints" in one_line(e.value)


# ----------------------------------------------------------------- the NaN/inf loss guard

def test_non_finite_loss_guard_names_the_first_bad_iteration():
    guard = NonFiniteLoss(CPU)
    for it, value in enumerate([0.5, 0.4, float("nan"), 0.3, float("inf")], start=1):
        guard.record(torch.tensor(value), it)
        if it < 3:
            guard.check("ckpt_2.pt")  # nothing to report yet
    with pytest.raises(FloatingPointError) as e:
        guard.check("ckpt_2.pt")
    message = one_line(e.value)
    assert "iteration 3" in message and "ckpt_2.pt" in message
    assert guard.due(7)  # on CPU every step is checked (reading a value costs nothing)
