"""inference.py before the rollout: which checkpoint, which config, which model, and the
one-line errors for everything a user can get wrong. In-process, on a real checkpoint that
`Checkpointer` writes for the untrained tiny model, and the tiny HDF5 data set."""

from __future__ import annotations

import importlib
import os
import shutil
import sys

import pytest
import torch
from helpers import CONFIG_FILE, layout_of, one_line

import inference
from evaluation.inference_flags import parse_flags
from networks import build_model
from networks.vit import vit_from_params
from training import trained_model
from training.checkpoint import Checkpointer, read_checkpoint
from training.progress import Progress
from training.run import build_optimizer, build_scheduler
from utils.config import read_config
from utils.errors import CheckpointError, ConfigError, DataError
from utils.precision import Precision


@pytest.fixture
def run_dir(tiny_params, tiny_data, tmp_path, monkeypatch):
    """<LOG_DIR>/tiny/1CPU/00 with ckpt_00000000.pt; DATA_DIR and LOG_DIR set as for a run."""
    monkeypatch.setenv("DATA_DIR", str(tiny_data))
    monkeypatch.setenv("LOG_DIR", str(tmp_path / "logs"))
    exp_dir = tmp_path / "logs" / "tiny" / "1CPU" / "00"
    saved = tiny_params.replace(tp=2)  # as a train_mp.py run would have saved it
    model = vit_from_params(saved)
    optimizer = build_optimizer(saved, model)
    Checkpointer(str(exp_dir), saved, model, optimizer, build_scheduler(saved, optimizer),
                 Precision("none").grad_scaler(), layout_of(tiny_params)).save(Progress())
    return exp_dir


def args(*flags: str):
    return parse_flags(flags)


def test_the_configs_run_is_found_under_log_dir(run_dir):
    assert trained_model.locate_checkpoint(args("--config=tiny")) == \
        str(run_dir / "checkpoints" / "ckpt_00000000.pt")
    assert trained_model.run_directory(trained_model.locate_checkpoint(args("--config=tiny"))) == \
        str(run_dir)


def test_of_several_runs_the_config_takes_the_one_saved_last(run_dir):
    newer = run_dir.parent.parent / "2CPU" / "03-tp=2"
    shutil.copytree(run_dir, newer)
    older = run_dir / "checkpoints" / "ckpt_00000000.pt"
    os.utime(older, (1e9, 1e9))
    notes: list[str] = []
    assert trained_model.locate_checkpoint(args("--config=tiny"), notes) == \
        str(newer / "checkpoints" / "ckpt_00000000.pt")
    assert notes == [f"2 runs of tiny have checkpoints; taking the newest, {newer} (choose "
                     "another with --run_dir or --run_num)"]
    assert trained_model.locate_checkpoint(args("--config=tiny", "--run_num=00")) == str(older)


def test_a_run_num_of_two_world_sizes_needs_run_dir(run_dir):
    shutil.copytree(run_dir, run_dir.parent.parent / "2CPU" / "00")
    with pytest.raises(ConfigError, match="2 runs of tiny named 00: .*; choose one with "
                                          "--run_dir"):
        trained_model.locate_checkpoint(args("--config=tiny", "--run_num=00"))


def test_a_config_never_trained_is_a_checkpoint_error(run_dir):
    with pytest.raises(CheckpointError, match=r"no checkpoint in .*/tiny/\*/07/checkpoints"):
        trained_model.locate_checkpoint(args("--config=tiny", "--run_num=07"))


def test_no_model_named_is_a_config_error():
    with pytest.raises(ConfigError, match="give --run_dir RUN_DIR, --checkpoint FILE or"):
        trained_model.locate_checkpoint(args())


def test_a_run_dir_without_checkpoints_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match=f"no checkpoint in {tmp_path}/checkpoints "
                                              r"\(--run_dir\): the run has saved none yet"):
        trained_model.locate_checkpoint(args(f"--run_dir={tmp_path}"))


def test_a_missing_run_dir_says_so_and_names_the_runs_beside_it(run_dir):
    """A mistyped run directory (here the world size and the name of a tp run) is not "no
    checkpoint": the error says the directory is missing and which runs there are."""
    logs = run_dir.parent.parent  # <LOG_DIR>/tiny
    shutil.copytree(run_dir, logs / "4CPU" / "00-tp=2")
    wrong = logs / "2CPU" / "00"
    with pytest.raises(CheckpointError) as e:
        trained_model.locate_checkpoint(args(f"--run_dir={wrong}"))
    assert str(e.value) == (f"no run directory {wrong} (--run_dir); runs with checkpoints in "
                            f"{logs}: 1CPU/00, 4CPU/00-tp=2")


@pytest.mark.parametrize("flags", [("--run_dir=/nonexistent/run",), ("--config=tiny",
                                                                      "--run_num=07")])
def test_a_missing_run_or_checkpoint_is_raised_alike_by_every_rank(run_dir, flags):
    """Every rank looks at the same path before any process group exists: one rank (0)
    prints the line for the job (training/script_exit.py)."""
    with pytest.raises(CheckpointError) as e:
        trained_model.locate_checkpoint(args(*flags))
    assert e.value.every_rank


def test_the_saved_config_is_relocated_by_data_dir_and_evaluated_serially(run_dir, tiny_data):
    path = trained_model.locate_checkpoint(args(f"--run_dir={run_dir}"))
    flagged, _ = trained_model.load_config(args("--tp=2", "--amp_mode=bf16"), path)
    assert (flagged.tp, flagged.amp_mode) == (2, "bf16")
    params, ckpt = trained_model.load_config(args(f"--run_dir={run_dir}"), path)
    assert params.config == "tiny" and params.inf_data_path == f"{tiny_data}/test"
    assert (params.tp, params.cp, params.amp_mode) == (1, 1, "none")  # saved tp 2: not used
    model = trained_model.load_model(params, ckpt, path, layout_of(params))
    for name, p in model.named_parameters():
        assert torch.equal(p, ckpt["model"][name]), name
    assert not model.training


def test_a_config_that_does_not_fit_the_checkpoint_is_refused(run_dir):
    path = trained_model.locate_checkpoint(args(f"--run_dir={run_dir}"))
    with pytest.raises(ConfigError) as e:
        trained_model.load_config(args("--config=cpu_short"), path)
    assert one_line(e) == (
        f"config 'cpu_short' has embed_dim=192, but {path} was trained from config 'tiny' "
        "with embed_dim=32: give --config=tiny, or leave out --config to evaluate it with "
        "the config saved in it")
    with pytest.raises(ConfigError, match="config 'tiny_ens' has ensemble_size=4, but .* "
                                          "was trained from config 'tiny' with ensemble_size=1"):
        trained_model.load_config(args("--config=tiny_ens"), path)


def _flag_trained(tiny_data, log_dir, flags: dict) -> str:
    """A checkpoint of `tiny` trained with `flags` (saved in it, as train.py saves them)."""
    cfg = read_config(CONFIG_FILE, "tiny", environ={"DATA_DIR": str(tiny_data)}, flags=flags)
    cfg = cfg.replace(local_batch_size=cfg.global_batch_size)
    model = build_model(cfg)
    optimizer = build_optimizer(cfg, model)
    exp_dir = log_dir / "tiny" / "1CPU" / "01-flagged"
    Checkpointer(str(exp_dir), cfg, model, optimizer, build_scheduler(cfg, optimizer),
                 Precision("none").grad_scaler(), layout_of(cfg)).save(Progress())
    return str(exp_dir / "checkpoints" / "ckpt_00000000.pt")


def test_a_flag_trained_ensemble_is_evaluated_by_its_config_name(run_dir, tiny_data, tmp_path):
    """`train.py --config=tiny --ensemble_size 4 --loss crps`, then `inference.py
    --config=tiny --ensemble_size 4`: what shapes the model comes from the run (its flags),
    the rest from the section; the checkpoint's every tensor loads."""
    path = _flag_trained(tiny_data, tmp_path / "logs", {"ensemble_size": 4, "loss": "crps"})
    assert trained_model.locate_checkpoint(args("--config=tiny")) == path  # the newest run
    cfg, ckpt = trained_model.load_config(args("--config=tiny", "--ensemble_size=4"), path)
    assert (cfg.config, cfg.ensemble_size, cfg.loss) == ("tiny", 4, "crps")
    assert cfg.flags == {"ensemble_size": 4, "loss": "crps"}
    model = trained_model.load_model(cfg, ckpt, path, layout_of(cfg))
    assert {n for n, _ in model.named_parameters()} == set(ckpt["model"])
    # its rank layout is the evaluation's own: a run's --ensemble_parallel_size is not taken
    path = _flag_trained(tiny_data, tmp_path / "logs", {"ensemble_size": 4, "loss": "crps",
                                                        "ensemble_parallel_size": 2})
    cfg, _ = trained_model.load_config(args("--config=tiny"), path)
    assert (cfg.ensemble_size, cfg.ensemble_parallel_size) == (4, 1)


def test_a_section_changed_since_the_run_is_one_line_naming_the_key(run_dir, tmp_path):
    path = trained_model.locate_checkpoint(args(f"--run_dir={run_dir}"))
    edited = tmp_path / "edited.yaml"
    edited.write_text(CONFIG_FILE.read_text())
    edited.write_text(edited.read_text().replace("  depth: 2\n", "  depth: 3\n", 1))
    with pytest.raises(ConfigError) as e:  # tiny itself edited since its run
        trained_model.load_config(args(f"--yaml_config={edited}", "--config=tiny"), path)
    assert one_line(e) == (
        f"config 'tiny' has depth=3, but {path} was trained with depth=2 (the section changed "
        "since): leave out --config to evaluate it with the config saved in it, or set "
        f"depth: 2 in config 'tiny' of {edited}")


def test_a_checkpoint_without_a_parameter_is_refused(run_dir, tiny_params):
    path = str(run_dir / "checkpoints" / "ckpt_00000000.pt")
    ckpt = read_checkpoint(path, None)
    del ckpt["model"]["head.weight"]
    with pytest.raises(CheckpointError, match=r"does not fit the model: no tensor for "
                                              r"parameter head.weight \(1 missing\)"):
        trained_model.load_model(tiny_params, ckpt, path, layout_of(tiny_params))


@pytest.mark.parametrize("flags, error, message", [
    (["--lead_steps=30"], DataError, "30-step rollout needs 31 consecutive samples"),
    (["--n_initial_conditions=21", "--lead_steps=4"], DataError,
     "--n_initial_conditions 21: .* has 20 initial conditions with room for 4 steps"),
    (["--channels", "t850", "q700"], ConfigError, "unknown channel q700; the data has u10,"),
    (["--map_channel=sst"], ConfigError, "unknown channel sst"),
    (["--tp=3"], ConfigError, "num_heads 4 is not divisible by tp 3 \\(--tp\\)"),
    (["--lead_steps=0"], ConfigError, "--lead_steps must be a positive integer, got 0"),
])
def test_bad_flags_are_one_line_errors_before_any_process_starts(run_dir, flags, error,
                                                                 message):
    with pytest.raises(error, match=message):
        inference.main(args(f"--run_dir={run_dir}", *flags))


def test_missing_test_data_names_the_directory(run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match=f"data directory {tmp_path}/nowhere/test does not"):
        inference.main(args(f"--run_dir={run_dir}"))


def test_importing_inference_leaves_the_environment_alone(monkeypatch):
    """The OpenMP policy is set by the script's start-up (training/startup.py), not by an
    import: with 4 threads on this machine's cores it would set OMP_WAIT_POLICY."""
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delitem(sys.modules, "inference")
    importlib.import_module("inference")
    assert "OMP_WAIT_POLICY" not in os.environ
