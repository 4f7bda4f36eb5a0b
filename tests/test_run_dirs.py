"""Run directories (training/run_dirs.py): every run its own name, and which earlier run
`--run_num`, `--resume` and a SLURM restart continue."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest
import torch
from helpers import CONFIG_FILE, run_distributed, run_script

from training.run_dirs import (
    MAX_LABEL,
    choose_run,
    create_run,
    newest_run_with_checkpoint,
    parse,
    run_label,
)
from utils.config import load_config

LABEL = "amp_mode=bf16-num_data_workers=4"


def make_run(parent: Path, name: str, checkpoint_time: float | None = None) -> Path:
    """A run directory; with a time, holding one checkpoint written at that time."""
    run = parent / name
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    if checkpoint_time is not None:
        ckpt = run / "checkpoints" / "ckpt_00000004.pt"
        ckpt.write_bytes(b"")
        os.utime(ckpt, (checkpoint_time, checkpoint_time))
    return run


def choose(parent: Path, label: str = "", run_num=None, resume=None, **environ):
    return choose_run(str(parent), label, run_num=run_num, resume=resume, environ=environ)


def new_name(parent: Path, label: str = "", **kw) -> str:
    choice = choose(parent, label, **kw)
    assert choice.new, choice
    return create_run(str(parent), choice.name, label)


# ----------------------------------------------------------------------------- the label

def test_the_label_lists_the_flags_that_change_the_training_in_a_fixed_order():
    assert run_label({"amp_mode": "bf16", "num_data_workers": 4}) == LABEL
    assert run_label({"tp": 2, "enable_jit": True, "prefetch_thread": False}) == "tp=2-enable_jit"


def test_how_long_and_how_kept_are_not_in_the_label():
    flags = {"num_iters": 64, "checkpoint_interval": 4, "checkpoint_keep": 2, "run_num": None,
             "amp_mode": "bf16"}
    assert run_label(flags) == "amp_mode=bf16"
    assert run_label({}) == ""


def test_a_path_is_named_by_its_file_and_odd_characters_become_underscores():
    assert run_label({"init_from": "logs/cpu_base/1CPU/00/checkpoints/ckpt_00001200.pt"}) == \
        "init_from=ckpt_00001200"
    assert run_label({"parallel_order": "tp cp:dp"}) == "parallel_order=tp_cp_dp"


def test_a_long_label_is_cut_and_ends_in_a_hash_of_the_whole():
    a = run_label({f"k{i}": "x" * 20 for i in range(8)})
    b = run_label({f"k{i}": "x" * 20 for i in range(7)} | {"k7": "y" * 20})
    assert len(a) == len(b) == MAX_LABEL and a != b
    assert a == run_label({f"k{i}": "x" * 20 for i in range(8)})  # the same flags, same name


def test_the_command_line_gives_the_label_in_the_flag_order_of_the_code():
    def label(flags):
        cfg = load_config(["--yaml_config", str(CONFIG_FILE), *flags], "t", model_parallel=True)
        return run_label(cfg.flags)

    a = label(["--config=tiny", "--num_data_workers", "4", "--amp_mode", "bf16",
               "--num_iters", "8", "--resume", "--noddp"])
    b = label(["--config=tiny", "--amp_mode", "bf16", "--noddp", "--num_data_workers", "4",
               "--bucket_cap_mb", "25"])  # 25: DDP's default, no change
    assert a == b == f"{LABEL}-noddp"
    assert label(["--config=tiny", "--bucket_cap_mb", "50"]) == "bucket_cap_mb=50"
    assert label(["--config=tiny", "--tp", "2"]) == "tp=2"


def test_names_parse_back_into_base_and_label():
    assert parse("03") == ("03", "")
    assert parse(f"03-{LABEL}") == ("03", LABEL)
    assert parse("job1234.2-tp=2") == ("job1234.2", "tp=2")
    assert parse("k2") is None and parse("jobless") is None


# ----------------------------------------------------------------------------- new runs

def test_every_new_run_takes_the_next_number_whatever_its_label(tmp_path):
    assert new_name(tmp_path) == "00"
    assert new_name(tmp_path, LABEL) == f"01-{LABEL}"
    make_run(tmp_path, "k2")  # a name of one's own (--run_num) takes no number
    assert new_name(tmp_path) == "02"
    assert sorted(os.listdir(tmp_path)) == ["00", f"01-{LABEL}", "02", "k2"]


def test_a_name_taken_meanwhile_moves_the_run_to_the_next_number(tmp_path):
    assert choose(tmp_path, "tp=2").name == "00"
    (tmp_path / "00-tp=2").mkdir()  # another run created it between choice and creation
    assert create_run(str(tmp_path), "00", "tp=2") == "01-tp=2"


def test_runs_started_at_the_same_moment_never_share_a_directory(tmp_path):
    names, barrier = [], threading.Barrier(8)

    def start():
        barrier.wait()
        names.append(new_name(tmp_path))

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(names)) == 8 and len(os.listdir(tmp_path)) == 8


def test_under_slurm_a_run_is_named_by_its_job_and_a_second_one_in_the_job_gets_a_suffix(
        tmp_path):
    assert new_name(tmp_path, "tp=2", SLURM_JOB_ID="1234") == "job1234-tp=2"
    assert new_name(tmp_path, "tp=2", SLURM_JOB_ID="1234") == "job1234.1-tp=2"
    assert new_name(tmp_path, "", SLURM_JOB_ID="1234") == "job1234"
    assert new_name(tmp_path, "", SLURM_JOB_ID="1235") == "job1235"


def test_an_explicit_run_num_is_reused_as_it_is(tmp_path):
    make_run(tmp_path, "00", checkpoint_time=1e9)
    choice = choose(tmp_path, LABEL, run_num="00", SLURM_JOB_ID="9")
    assert (choice.name, choice.new) == ("00", False)


# ----------------------------------------------------------------------------- continuing

def test_a_requeued_job_continues_its_own_run_not_a_newer_one(tmp_path):
    make_run(tmp_path, "job1234-tp=2", checkpoint_time=1e9)
    make_run(tmp_path, "job1234-amp_mode=bf16", checkpoint_time=3e9)  # same job, other flags
    make_run(tmp_path, "job1300-tp=2", checkpoint_time=2e9)  # a later job of the same flags
    for resume in (None, "auto"):  # resumed (--requeue) or restarted afresh: its own directory
        choice = choose(tmp_path, "tp=2", resume=resume, SLURM_JOB_ID="1234",
                        SLURM_RESTART_COUNT="1")
        assert (choice.name, choice.new) == ("job1234-tp=2", False)
        assert "SLURM restart 1 of job 1234" in choice.why


def test_a_requeued_job_that_ran_twice_continues_the_later_run(tmp_path):
    make_run(tmp_path, "job77")
    make_run(tmp_path, "job77.1")
    assert choose(tmp_path, SLURM_JOB_ID="77", SLURM_RESTART_COUNT="2").name == "job77.1"


def test_a_first_attempt_of_a_job_does_not_reuse_its_directory(tmp_path):
    make_run(tmp_path, "job5")  # e.g. an earlier training in the same allocation
    assert new_name(tmp_path, SLURM_JOB_ID="5", SLURM_RESTART_COUNT="0") == "job5.1"


def test_resume_continues_the_run_of_the_same_flags_with_the_newest_checkpoint(tmp_path):
    make_run(tmp_path, f"00-{LABEL}", checkpoint_time=2e9)
    make_run(tmp_path, f"01-{LABEL}", checkpoint_time=1e9)  # numbered later, saved earlier
    make_run(tmp_path, f"02-{LABEL}")  # no checkpoint
    make_run(tmp_path, "03", checkpoint_time=3e9)  # other flags
    make_run(tmp_path, f"job7-{LABEL}", checkpoint_time=1.5e9)
    choice = choose(tmp_path, LABEL, resume="auto")
    assert (choice.name, choice.new) == (f"00-{LABEL}", False)
    # a new job resuming takes the same run: the training goes on in one directory
    assert choose(tmp_path, LABEL, resume="auto", SLURM_JOB_ID="8").name == f"00-{LABEL}"
    assert newest_run_with_checkpoint(str(tmp_path)) == "03"


def test_resume_without_an_earlier_checkpoint_starts_a_new_run_and_says_so(tmp_path):
    make_run(tmp_path, "00")
    make_run(tmp_path, "01-tp=2", checkpoint_time=1e9)
    choice = choose(tmp_path, "", resume="auto")
    assert (choice.name, choice.new) == ("02", True)
    assert "no earlier run of these flags has a checkpoint" in choice.why


def test_resume_from_a_file_continues_the_run_that_holds_it(tmp_path):
    run = make_run(tmp_path, "03-tp=2", checkpoint_time=1e9)
    ckpt = str(run / "checkpoints" / "ckpt_00000004.pt")
    choice = choose(tmp_path, "", resume=ckpt)  # the flags need not match: the file says
    assert (choice.name, choice.new) == ("03-tp=2", False)
    elsewhere = make_run(tmp_path.parent / "other", "00", checkpoint_time=1e9)
    choice = choose(tmp_path, "", resume=str(elsewhere / "checkpoints" / "ckpt_00000004.pt"))
    assert (choice.name, choice.new) == ("04", True)


# ----------------------------------------------------------------------------- all ranks

def _resolve(log_dir: str) -> tuple[str, str]:
    from training.setup import choose_run_dir
    from utils.config import read_config

    cfg = read_config(CONFIG_FILE, "tiny", environ={"LOG_DIR": log_dir}, flags={"tp": 2})
    return choose_run_dir(cfg, torch.device("cpu"))


@pytest.mark.distributed
def test_rank_0_names_the_run_and_every_rank_writes_to_it(tmp_path):
    make_run(tmp_path / "tiny" / "2CPU", "04")
    first = run_distributed(_resolve, 2, str(tmp_path))
    second = run_distributed(_resolve, 2, str(tmp_path))
    assert first[0] == first[1] == (str(tmp_path / "tiny" / "2CPU" / "05-tp=2"), "a new run")
    assert second[0][0] == second[1][0] == str(tmp_path / "tiny" / "2CPU" / "06-tp=2")
    assert sorted(os.listdir(tmp_path / "tiny" / "2CPU")) == ["04", "05-tp=2", "06-tp=2"]


# ----------------------------------------------------------------------------- train.py

def tensorboard_runs(log_dir: Path) -> list[str]:
    """The runs TensorBoard lists for `tensorboard --logdir log_dir`."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    return sorted(EventMultiplexer().AddRunsFromDirectory(str(log_dir)).Runs())


@pytest.mark.e2e
def test_two_runs_of_one_command_are_two_tensorboard_runs_and_resume_continues_the_newest(
        tiny_data, tmp_path):
    log_dir, runs = tmp_path / "logs", tmp_path / "logs" / "tiny" / "1CPU"
    args = ["--config=tiny", "--num_iters=4", "--checkpoint_interval=4"]

    def train(*flags: str):
        run = run_script("train.py", [*args, *flags], data_dir=tiny_data, log_dir=log_dir,
                         timeout=240)
        assert run.returncode == 0 and "Finished" in run.stdout, run.output[-3000:]
        return run

    first, second, bf16 = train(), train(), train("--amp_mode=bf16")
    assert [r.exp_dir() for r in (first, second, bf16)] == \
        [runs / "00", runs / "01", runs / "02-amp_mode=bf16"]
    for run in (first, second, bf16):  # the log names the directory before anything else
        out_log = (run.exp_dir() / "out.log").read_text().splitlines()
        assert f"Run directory {run.exp_dir()} (a new run)" in out_log[0]
        assert len(list((run.exp_dir() / "logs").glob("events.out.tfevents.*"))) == 1
    assert tensorboard_runs(log_dir) == \
        ["tiny/1CPU/00/logs", "tiny/1CPU/01/logs", "tiny/1CPU/02-amp_mode=bf16/logs"]

    resumed = train("--num_iters=8", "--resume")  # a longer run continues the newest one
    assert resumed.exp_dir() == runs / "01"
    assert f"Resumed from {runs / '01' / 'checkpoints' / 'ckpt_00000004.pt'}: iteration 4" \
        in resumed.stdout
    assert "Finished 8 iterations" in resumed.stdout
    assert len(tensorboard_runs(log_dir)) == 3


def test_the_readme_ladder_names_the_runs_as_train_py_names_them():
    """README step 6: each ladder command's comment is the directory it gets in a fresh
    logs/cpu_short/1CPU (the numbers in order, the labels from the flags)."""
    readme = (CONFIG_FILE.parent.parent / "README.md").read_text()
    block = readme[readme.index("**The ladder, one TensorBoard run"):readme.index("### 7.")]
    command = r"^python train\.py (--config=cpu_short(?=\s)(?: --\S+(?: [^-#\s]\S*)?)*)"
    commands = re.findall(command, block, flags=re.M)
    names = re.findall(r"#\s+(\d\d(?:-\S+)?)", block)
    assert len(commands) == len(names) == 6, (commands, names)
    for i, (command, name) in enumerate(zip(commands, names, strict=True)):
        flags = ["--yaml_config", str(CONFIG_FILE), *command.split()]
        label = run_label(load_config(flags, "t").flags)
        assert name == (f"{i:02d}-{label}" if label else f"{i:02d}"), command
