"""Bad input ends a train script with exit code 2 and one line, `error: <what and where>`,
never a traceback: config, flags, data, layout, checkpoint, output directory, and a
training loss that turns NaN/inf (which also must not reach a checkpoint): from non-finite
data (the line names the file, sample and channel) or from a diverging model (the lr).

Every case is a real subprocess; they run a few at a time (module fixture) since most of
each one is Python start-up.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from bad_data import copy_data, damage_chunk, flip_tensor_byte, rewrite, set_value
from helpers import CONFIG_FILE, REPO, TrainRun, assert_one_error_line, free_port, run_script

from training.checkpoint import list_checkpoints

pytestmark = pytest.mark.e2e

TIMEOUT = 180


@dataclass
class Case:
    words: list[str]                      # what the error line must name
    args: list[str] = field(default_factory=lambda: ["--config=tiny"])
    script: str = "train.py"
    env: dict[str, str] = field(default_factory=dict)
    data_dir: Path | None = None          # None: the tiny data set
    log_dir: Path | None = None


def _yaml(tmp: Path, extra: str) -> Path:
    """config/ViT.yaml plus `extra` sections, which may merge its anchors (<<: *tiny)."""
    path = tmp / "config.yaml"
    path.write_text(CONFIG_FILE.read_text() + "\n" + extra)
    return path


def _data_copy(tmp: Path, tiny_data: Path) -> Path:
    out = tmp / "data"
    shutil.copytree(tiny_data, out)
    return out


# Each case writes what it needs into its own directory `d` and returns how to run it.
CASES: dict[str, Callable[[Path, Path], Case]] = {}


def case(fn: Callable[[Path, Path], Case]) -> Callable[[Path, Path], Case]:
    CASES[fn.__name__.lstrip("_")] = fn
    return fn


@case
def _unknown_config(d, tiny_data):  # the error lists the valid names
    return Case(["unknown config 'no_such_config'", "config/ViT.yaml", "tiny", "cpu_short"],
                ["--config=no_such_config"])

@case
def _malformed_yaml(d, tiny_data):
    bad = d / "bad.yaml"
    bad.write_text("tiny:\n  lr: [1.0e-3\n  depth: 2\n")
    return Case(["malformed YAML", str(bad)], ["--config=tiny", f"--yaml_config={bad}"])

@case
def _model_parallel_config_for_train_py(d, tiny_data):  # train.py's layout is data-parallel
    path = _yaml(d, "tiny_tp2: {<<: *tiny, tp: 2}\n")
    return Case(["config 'tiny_tp2' sets tp 2", "train.py trains data-parallel only",
                 "train_mp.py"], ["--config=tiny_tp2", f"--yaml_config={path}"])

@case
def _unknown_flag_value(d, tiny_data):  # argparse: a usage line, then one error line
    return Case(["--amp_mode", "fp8"], ["--config=tiny", "--amp_mode=fp8"])

@case
def _bad_flag_value(d, tiny_data):  # checked by the config schema, before any data is read
    return Case(["error: bad value --checkpoint_keep 0: expected int > 0"],
                ["--config=tiny", "--checkpoint_keep", "0"], data_dir=d / "no_data")

@case
def _missing_data_directory(d, tiny_data):
    return Case([str(d / "none" / "train"), "does not exist"], data_dir=d / "none")

@case
def _empty_data_directory(d, tiny_data):
    for sub in ("train", "valid", "test", "stats"):
        (d / "data" / sub).mkdir(parents=True)
    return Case(["no .h5 files", str(d / "data" / "train")], data_dir=d / "data")

@case
def _wrong_hdf5_layout(d, tiny_data):
    data = _data_copy(d, tiny_data)
    bad = sorted((data / "train").glob("*.h5"))[0]
    bad.unlink()
    with h5py.File(bad, "w") as f:
        f["temperature"] = np.zeros((4, 20, 16, 32), np.float32)
    return Case([str(bad), "no dataset 'fields'", "temperature"], data_dir=data)

@case
def _stats_shape_mismatch(d, tiny_data):
    data = _data_copy(d, tiny_data)
    np.save(data / "stats" / "global_means.npy", np.zeros((1, 5, 1, 1), np.float32))
    return Case(["global_means.npy", "(1, 5, 1, 1)", "expected (1, 20"], data_dir=data)

@case
def _img_size_not_a_multiple_of_patch(d, tiny_data):
    cfg = _yaml(d, "bad_patch:\n  <<: *tiny\n  patch_size: 5\n")
    return Case(["img_size 16x32", "patch_size 5"],
                ["--config=bad_patch", f"--yaml_config={cfg}"])

@case
def _heads_not_divisible_by_tp(d, tiny_data):
    return Case(["num_heads 4", "tp 3"], ["--config=tiny", "--tp=3"], script="train_mp.py")

@case
def _world_not_divisible_by_tp_cp(d, tiny_data):
    return Case(["world size 1", "tp x cp x h x w x ens = 2 x 1 x 1 x 1 x 1"],
                ["--config=tiny", "--tp=2"], script="train_mp.py")

@case
def _dali_unavailable(d, tiny_data):
    # An `nvidia` package without `dali` ahead of the installed one: DALI is "missing".
    (d / "nvidia").mkdir()
    (d / "nvidia" / "__init__.py").write_text("")
    return Case(["data_loader_config 'dali' needs NVIDIA DALI", "nvidia.dali"],
                ["--config=tiny", "--data_loader_config=dali"],
                env={"PYTHONPATH": f"{d}:{REPO}"})

@case
def _output_directory_not_writable(d, tiny_data):
    # Under a regular file: fails for root too (chmod would not stop root).
    blocker = d / "a_file"
    blocker.write_text("")
    return Case(["cannot write the run directory", str(blocker / "logs"), "LOG_DIR"],
                log_dir=blocker / "logs")

@case
def _corrupt_checkpoint(d, tiny_data):
    bad = d / "ckpt_00000004.pt"
    torch.save({"model": {"w": torch.ones(100)}}, bad)
    bad.write_bytes(bad.read_bytes()[:200])  # truncated
    return Case([str(bad), "unreadable"], ["--config=tiny", f"--resume={bad}"])

@case
def _nan_loss(d, tiny_data):  # finite data, a diverging model: the lr advice
    cfg = _yaml(d, "nan_lr:\n  <<: *tiny\n  lr: 1.0e+30\n")
    return Case(["training loss is NaN/inf at iteration", "ckpt_00000001.pt", "is kept",
                 "data are finite", "lower the lr"],
                ["--config=nan_lr", f"--yaml_config={cfg}", "--checkpoint_interval=1"],
                log_dir=d / "logs")

# Bad data. The tiny run reads rows 0-9 of 2017.h5 in every epoch (limit_nsamples 32).

@case
def _nan_in_a_training_sample(d, tiny_data):  # the file, sample and channel; no lr advice
    data = copy_data(tiny_data, d / "data")
    set_value(data / "train" / "2017.h5", row=5, channel=3, value=np.nan)
    return Case([f"{data / 'train' / '2017.h5'}: sample 5", "channel 3 (sp)", "1 NaN value",
                 "training loss is NaN/inf at iteration", "fix or replace that sample"],
                data_dir=data)

@case
def _inf_in_a_training_sample(d, tiny_data):
    data = copy_data(tiny_data, d / "data")
    set_value(data / "train" / "2017.h5", row=8, channel=7, value=np.inf)
    return Case([f"{data / 'train' / '2017.h5'}: sample 8", "channel 7 (v1000)", "1 inf value"],
                data_dir=data)

@case
def _zero_std_in_the_stats(d, tiny_data):
    data = copy_data(tiny_data, d / "data")
    stds = np.load(data / "stats" / "global_stds.npy")
    stds[0, 3] = 0.0
    np.save(data / "stats" / "global_stds.npy", stds)
    return Case([str(data / "stats" / "global_stds.npy"), "channel 3 (sp) is 0", "> 0"],
                data_dir=data)

@case
def _nan_mean_in_the_stats(d, tiny_data):
    data = copy_data(tiny_data, d / "data")
    means = np.load(data / "stats" / "global_means.npy")
    means[0, 5] = np.nan
    np.save(data / "stats" / "global_means.npy", means)
    return Case([str(data / "stats" / "global_means.npy"), "channel 5 (t850)", "NaN"],
                data_dir=data)

@case
def _damaged_compressed_chunk(d, tiny_data):  # read by a DataLoader worker process
    data = copy_data(tiny_data, d / "data")
    rewrite(data / "train" / "2017.h5", compression="gzip")
    damage_chunk(data / "train" / "2017.h5", row=5)
    return Case([f"{data / 'train' / '2017.h5'}: cannot read sample 5", "damaged"],
                ["--config=tiny", "--num_data_workers=1"], data_dir=data)

@case
def _damaged_compressed_chunk_read_by_dali(d, tiny_data):  # a DALI worker process
    data = copy_data(tiny_data, d / "data")
    rewrite(data / "train" / "2017.h5", compression="gzip")
    damage_chunk(data / "train" / "2017.h5", row=5)
    return Case([f"{data / 'train' / '2017.h5'}: cannot read sample 5", "damaged"],
                ["--config=tiny", "--data_loader_config=dali", "--num_data_workers=2"],
                data_dir=data)

@case
def _fields_of_a_non_numeric_type(d, tiny_data):
    data = copy_data(tiny_data, d / "data")
    rewrite(data / "train" / "2016.h5", dtype="c8")
    return Case([str(data / "train" / "2016.h5"), "type complex64", "expected float32"],
                data_dir=data)

@case
def _checkpoint_with_a_flipped_byte(d, tiny_data):  # torch.load would read it silently
    bad = d / "ckpt_00000004.pt"
    torch.save({"model": {"w": torch.ones(1000)}}, bad)
    flip_tensor_byte(bad)
    return Case([str(bad), "fails its CRC check"], ["--config=tiny", f"--resume={bad}"])


@case
def _deterministic_checkpoint_resumed_as_an_ensemble(d, tiny_data):  # init_from is the way
    from training.checkpoint import FORMAT, MODEL_KEYS, VERSION
    from utils.config import read_config

    cfg = read_config(CONFIG_FILE, "tiny", environ={"DATA_DIR": str(tiny_data)})
    path = d / "ckpt_00000004.pt"  # all a checkpoint holds but tensors, which are not read
    torch.save({"format": FORMAT, "version": VERSION, "params": cfg.model_dump(),
                "config": {k: getattr(cfg, k) for k in MODEL_KEYS}, "model": {},
                "optimizer": {}, "scheduler": {}, "scaler": {}, "iters": 4, "epoch": 1,
                "epoch_step": 4, "rng": []}, path)
    return Case([str(path), "holds a deterministic model", "an ensemble of 4",
                 f"--init_from {path}"], ["--config=tiny_ens", f"--resume={path}"])


def _cases(tmp: Path, tiny_data: Path) -> dict[str, Case]:
    """Each case gets its own directory `tmp / name`."""
    cases = {}
    for name, make in CASES.items():
        (tmp / name).mkdir()
        cases[name] = make(tmp / name, tiny_data)
    return cases


def _run(case: Case, tiny_data: Path, tmp: Path, env: dict[str, str] | None = None
         ) -> TrainRun:
    return run_script(case.script, case.args, data_dir=case.data_dir or tiny_data,
                      log_dir=case.log_dir or tmp / "logs", env_extra={**case.env, **(env or {})},
                      timeout=TIMEOUT)


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> dict[str, TrainRun | list[TrainRun]]:
    tmp = tmp_path_factory.mktemp("errors")
    cases = _cases(tmp, tiny_data)
    # Global batch 3 over 2 data-parallel ranks: two processes joined by the environment
    # variables a launcher sets (srun / export_DDP_vars.sh), each must say it in one line.
    cfg = _yaml(tmp, "odd_batch:\n  <<: *tiny\n  global_batch_size: 3\n")
    dp = Case(["error: global_batch_size 3 is not divisible by the data-parallel size 2"],
              ["--config=odd_batch", f"--yaml_config={cfg}"])
    port = str(free_port())
    with ThreadPoolExecutor(4) as pool:
        futures = {name: pool.submit(_run, c, tiny_data, tmp / name) for name, c in cases.items()}
        dp_futures = [pool.submit(_run, dp, tiny_data, tmp, {
            "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for r in range(2)]
        results: dict[str, TrainRun | list[TrainRun]] = {
            name: f.result() for name, f in futures.items()}
        results["batch_not_divisible_by_dp"] = [f.result() for f in dp_futures]
    results["_cases"] = {**cases, "batch_not_divisible_by_dp": dp}  # type: ignore[assignment]
    return results


NAMES = ["unknown_config", "malformed_yaml", "model_parallel_config_for_train_py",
         "unknown_flag_value", "bad_flag_value",
         "missing_data_directory",
         "empty_data_directory", "wrong_hdf5_layout", "stats_shape_mismatch",
         "img_size_not_a_multiple_of_patch", "batch_not_divisible_by_dp",
         "heads_not_divisible_by_tp", "world_not_divisible_by_tp_cp", "dali_unavailable",
         "output_directory_not_writable", "corrupt_checkpoint", "nan_loss",
         "nan_in_a_training_sample", "inf_in_a_training_sample", "zero_std_in_the_stats",
         "nan_mean_in_the_stats", "damaged_compressed_chunk",
         "damaged_compressed_chunk_read_by_dali", "fields_of_a_non_numeric_type",
         "checkpoint_with_a_flipped_byte", "deterministic_checkpoint_resumed_as_an_ensemble"]


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_is_one_error_line_and_exit_code_2(runs, name):
    case = runs["_cases"][name]
    if isinstance(runs[name], list):  # the ranks of one job: rank 0 alone says it
        rank0, *others = runs[name]
        for run in others:
            assert run.returncode == 2, run.output[-3000:]
            assert "error:" not in run.output and "Traceback" not in run.output, run.output
        runs = {name: rank0}
    line = assert_one_error_line(runs[name], case.words)
    if name != "unknown_flag_value":  # argparse words its own line (prog: error: ...)
        assert line.startswith("error: "), line
        # ... and that line is all a user sees on stderr: no warning, no log record
        lines = [out for out in runs[name].stderr.splitlines() if out.strip()]
        assert lines == [line], runs[name].stderr


def test_a_nan_loss_keeps_the_last_good_checkpoint(runs):
    """lr 1e30: iteration 1 leaves huge but finite weights (saved), iteration 2's loss is
    NaN: the run stops there, and nothing after the good checkpoint is written."""
    exp = runs["nan_loss"].exp_dir("nan_lr")
    files = list_checkpoints(str(exp))
    assert [Path(f).name for f in files] == ["ckpt_00000001.pt"]
    ckpt = torch.load(files[0], weights_only=True)
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())
    assert "iteration 2" in runs["nan_loss"].stderr
