"""A start that goes wrong, with real processes, signals and file systems:

  - a full disk (a real 1 MB tmpfs, filled up), or one too small for the checkpoints:
    exit 2 and one line naming the directory and its free space, at once;
  - SIGUSR1/SIGTERM during start-up, before training: exit 3, "nothing to save" (before,
    SIGUSR1 killed the process without a word, exit 138);
  - `--resume` (auto) whose newest checkpoint is damaged: a warning, and the run resumes
    from the newest intact one.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, assert_one_error_line, child_env, run_script

from training.checkpoint import list_checkpoints
from utils.errors import EXIT_PREEMPTED

TIMEOUT = 180


# ----------------------------------------------------------------------------- a full disk

@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs, mounted for this test and unmounted after it (needs root)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root (mount -t tmpfs)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def fill(directory: Path) -> None:
    """Write until the file system says it is full."""
    with open(directory / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


@pytest.mark.e2e
@pytest.mark.parametrize("state, words", [
    ("full", ["cannot write the run directory", "No space left on device", "0 B free"]),
    ("too small", ["not enough room for checkpoints", "checkpoints", "free",
                   "checkpoint_keep 3"]),
])
def test_a_disk_without_room_stops_the_run_at_start_up(small_disk, tiny_data, state, words):
    if state == "full":
        fill(small_disk)
    log_dir = small_disk / "logs"
    run = run_script("train.py", ["--config=tiny"], data_dir=tiny_data, log_dir=log_dir,
                     timeout=TIMEOUT)
    line = assert_one_error_line(run, [str(log_dir / "tiny" / "1CPU" / "00"), *words])
    assert "Logging error" not in run.output, run.output[-3000:]
    assert "Initial val loss" not in run.output  # stopped before any work
    if state == "too small":
        assert re.search(r"[\d.]+ [kM]B free", line), line


# ----------------------------------------------------------------------------- early signals

def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (Linux: SigCgt in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(mask, 16) >> (signum - 1) & 1)


@pytest.mark.e2e
@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_a_stop_signal_during_start_up_exits_3_with_nothing_to_save(tiny_data, tmp_path,
                                                                    signum):
    """The signal comes the moment the handler is in place: while the script is still
    importing torch. The run stops there, says so, and writes no checkpoint."""
    env = child_env({"DATA_DIR": str(tiny_data), "LOG_DIR": str(tmp_path / "logs")})
    proc = subprocess.Popen([sys.executable, "train.py", "--config=tiny"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not catches(proc.pid, signum):
            assert proc.poll() is None and time.monotonic() < deadline, "no handler installed"
            time.sleep(0.002)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, (proc.returncode, out[-2000:], err[-2000:])
    name = signal.Signals(signum).name
    assert err.strip() == f"stopped by {name} before training started: nothing to save", err
    assert "Traceback" not in out + err and "Starting training loop" not in out
    assert not list(tmp_path.rglob("ckpt_*.pt"))


# ----------------------------------------------------------------------------- --resume auto

@pytest.mark.e2e
def test_resume_auto_continues_from_the_newest_intact_checkpoint(tiny_data, tmp_path):
    log_dir = tmp_path / "logs"
    args = ["--config=tiny", "--num_iters=8", "--checkpoint_interval=4"]
    first = run_script("train.py", args, data_dir=tiny_data, log_dir=log_dir, timeout=TIMEOUT)
    assert first.returncode == 0, first.output[-3000:]
    exp = first.exp_dir("tiny")
    four, eight = (Path(p) for p in list_checkpoints(str(exp)))
    eight.write_bytes(eight.read_bytes()[:5000])  # cut short, as by a full disk or a kill
    resumed = run_script("train.py", [*args, "--resume"], data_dir=tiny_data, log_dir=log_dir,
                         timeout=TIMEOUT)
    assert resumed.returncode == 0, resumed.output[-3000:]
    warnings = [line for line in resumed.output.splitlines() if "WARNING" in line]
    assert any(f"--resume: skipping {eight}, it is damaged" in w for w in warnings), warnings
    assert f"Resumed from {four}: iteration 4" in resumed.output
    assert "Finished 8 iterations" in resumed.output
    assert list_checkpoints(str(exp))[-1] == str(eight)  # written again, intact
