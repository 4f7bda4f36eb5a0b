"""Preemption and failures with real processes and real signals (training/preemption.py).

  - one process with two DataLoader workers, SIGUSR1 to all of them once training has
    started (as SLURM signals every process of a step): checkpoint, exit 3, `scontrol
    requeue` (a stand-in scontrol on PATH); the restarted run (SLURM_RESTART_COUNT=1,
    `--requeue`) resumes by itself and ends bitwise equal to the uninterrupted run;
  - a 2-rank torchrun job, SIGTERM to torchrun: it forwards SIGTERM to both workers, which
    save together and exit 3 (torchrun exits 1); `--resume` ends bitwise equal to the
    uninterrupted DDP run;
  - a signal that reaches one rank only stops every rank (the all-reduce of the flag);
  - a rank that dies (SIGKILL) ends the whole torchrun job within seconds, and torchrun's
    summary names it.

The uninterrupted runs are conftest's `reference_run`s (one per pytest session), which
test_resume.py and the parallel tests compare with too.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from helpers import (
    REPO,
    TINY_ITERS,
    assert_completed,
    assert_same_state,
    child_env,
    epoch_losses,
    final_checkpoint,
    free_port,
    run_distributed,
    run_script,
)

from training.checkpoint import list_checkpoints
from training.preemption import StopSignal
from utils.errors import EXIT_PREEMPTED

ITERS = TINY_ITERS
TIMEOUT = 240  # seconds per run
STARTED = "Starting training loop"
# The interrupted runs: the reference's settings, without periodic checkpoints (so the only
# checkpoint is the one the signal makes) and without --resume.
SIGNALLED_ARGS = ("--config=tiny", f"--num_iters={ITERS}", "--checkpoint_interval=0")


class LiveRun:
    """A train script started in the background (its own session, so a hung run can be
    killed as a group); its output is collected line by line while the test acts on it."""

    def __init__(self, script: str, args: Sequence[str], *, data_dir: Path, log_dir: Path,
                 nproc: int | None = None, env_extra: Mapping[str, str] | None = None):
        cmd = [sys.executable]
        if nproc:
            cmd += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                    "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
        cmd += [script, *args]
        env = child_env({"DATA_DIR": str(data_dir), "LOG_DIR": str(log_dir),
                         **(env_extra or {})})
        self.log_dir = log_dir
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            try:
                line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.kill()
                pytest.fail(f"no {text!r} after {timeout:.0f} s:\n{self.output[-4000:]}")
            if line is None:
                pytest.fail(f"exited ({self.proc.wait()}) before {text!r}:\n"
                            f"{self.output[-4000:]}")
            self.lines.append(line)

    def wait(self, timeout: float = TIMEOUT) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running after {timeout:.0f} s:\n{self.output[-4000:]}")
        while (line := self._queue.get(timeout=30)) is not None:
            self.lines.append(line)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def stopped_at(output: str, signum: int) -> int:
    m = re.search(rf"Signal {signum} received: stopped at iteration (\d+)", output)
    assert m, output[-4000:]
    return int(m.group(1))


def resume_line(k: int) -> str:
    """What a run resumed from iteration k logs (tiny: 8 iterations per epoch)."""
    epoch = (k - 1) // 8 + 1
    return f"iteration {k}, epoch {epoch}, {k - 8 * (epoch - 1)} batches into it"


def fake_scontrol(tmp_path: Path) -> tuple[Path, Path]:
    """An `scontrol` that only records its arguments: (directory to put on PATH, record)."""
    bin_dir, record = tmp_path / "bin", tmp_path / "scontrol.args"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{record}"\n')
    script.chmod(0o755)
    return bin_dir, record


def _in_background(fn, *args, **kwargs) -> Future:
    """Run `fn` in a thread: the uninterrupted reference runs while the test signals."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn, *args, **kwargs)
    pool.shutdown(wait=False)
    return future


# ----------------------------------------------------------------- one process, SIGUSR1

@pytest.mark.e2e
def test_sigusr1_checkpoints_requeues_and_the_restart_resumes_exactly(reference_run, tiny_data,
                                                                      tmp_path):
    reference = _in_background(reference_run, "train.py")
    bin_dir, record = fake_scontrol(tmp_path)
    slurm = {"SLURM_JOB_ID": "4242", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    log_dir = tmp_path / "logs"

    # Two DataLoader workers, and the signal goes to every process of the run, as SLURM
    # sends it to every process of a job step: the workers must survive it too.
    args = [*SIGNALLED_ARGS, "--requeue", "--num_data_workers=2"]
    run = LiveRun("train.py", args, data_dir=tiny_data, log_dir=log_dir, env_extra=slurm)
    run.wait_for(STARTED)
    os.killpg(run.proc.pid, signal.SIGUSR1)
    assert run.wait() == EXIT_PREEMPTED, run.output[-4000:]
    k = stopped_at(run.output, signal.SIGUSR1)
    assert 1 <= k < ITERS
    exp = log_dir / "tiny" / "1CPU" / "job4242-num_data_workers=2"  # the job's own run
    assert [Path(p).name for p in list_checkpoints(str(exp))] == [f"ckpt_{k:08d}.pt"]
    assert record.read_text().split() == ["requeue", "4242"]
    assert "SLURM job 4242 requeued" in run.output
    assert "Traceback" not in run.output

    # What SLURM reruns: the same command line, now with SLURM_RESTART_COUNT=1.
    restart = run_script("train.py", args, data_dir=tiny_data, log_dir=log_dir,
                         env_extra={**slurm, "SLURM_RESTART_COUNT": "1"}, timeout=TIMEOUT)
    assert_completed(restart, ITERS)
    assert "SLURM restart 1 of a --requeue job: resuming" in restart.stdout
    assert restart.exp_dir() == exp  # the restarted job found its own run
    assert re.search(rf"Resumed from \S+ckpt_{k:08d}\.pt: {resume_line(k)}", restart.stdout), \
        restart.stdout[-3000:]
    reference = reference.result()
    assert_same_state(final_checkpoint(exp), final_checkpoint(reference.exp_dir()))
    assert epoch_losses(restart.stdout) == epoch_losses(reference.stdout)
    assert record.read_text().split() == ["requeue", "4242"]  # no second requeue


# ----------------------------------------------------------------- torchrun, SIGTERM

@pytest.mark.e2e
def test_torchrun_forwards_sigterm_and_both_ranks_save_then_resume_exactly(reference_run,
                                                                           tiny_data,
                                                                           tmp_path):
    """torchrun's agent forwards SIGTERM to its workers and waits up to 30 s
    (--shutdown_timeout) before SIGKILL: enough for them to checkpoint."""
    reference = _in_background(reference_run, "train.py", nproc=2)
    log_dir = tmp_path / "logs"
    run = LiveRun("train.py", SIGNALLED_ARGS, data_dir=tiny_data, log_dir=log_dir, nproc=2)
    run.wait_for(STARTED)
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    code = run.wait()
    assert time.monotonic() - sent < 30, "torchrun had to SIGKILL the workers"
    assert code == 1, run.output[-4000:]  # torchrun reports the signal it got
    assert "Received 15 death signal, shutting down workers" in run.output
    k = stopped_at(run.output, signal.SIGTERM)
    exp = log_dir / "tiny" / "2CPU" / "00"
    assert [Path(p).name for p in list_checkpoints(str(exp))] == [f"ckpt_{k:08d}.pt"]
    assert "SIGKILL" not in run.output

    resumed = run_script("train.py", [*SIGNALLED_ARGS, "--resume"], data_dir=tiny_data,
                         log_dir=log_dir, nproc=2, timeout=TIMEOUT)
    assert_completed(resumed, ITERS)
    assert resume_line(k) in resumed.stdout, resumed.stdout[-3000:]
    reference = reference.result()
    assert_same_state(final_checkpoint(exp), final_checkpoint(reference.exp_dir("tiny", 2)))
    assert epoch_losses(resumed.stdout) == epoch_losses(reference.stdout)


# ----------------------------------------------------------------- agreement and failures

def _one_rank_signalled() -> tuple[bool, bool]:
    import torch
    import torch.distributed as dist

    stop = StopSignal()
    before = stop.should_stop(torch.device("cpu"))
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGUSR1)  # only this rank hears it
    return before, stop.should_stop(torch.device("cpu"))


@pytest.mark.distributed
def test_a_signal_to_one_rank_stops_every_rank():
    assert run_distributed(_one_rank_signalled, 2) == [(False, True), (False, True)]


def _worker_with_rank(launcher: psutil.Process, rank: int, timeout: float = 60
                      ) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in launcher.children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank):
                    return child
            except psutil.Error:  # exited or not readable yet
                continue
        time.sleep(0.1)
    pytest.fail(f"no worker with RANK={rank} under torchrun")


@pytest.mark.e2e
def test_a_dead_rank_ends_the_job_quickly_and_is_named(tiny_data, tmp_path):
    """Rank 1 is SIGKILLed mid-training. Rank 0's next collective fails (gloo sees the
    closed connection; DIST_TIMEOUT_SEC bounds it otherwise), torchrun stops the group and
    names rank 1 as the first failure."""
    run = LiveRun("train.py", ["--config=tiny", "--num_iters=400", "--checkpoint_interval=0"],
                  data_dir=tiny_data, log_dir=tmp_path / "logs", nproc=2,
                  env_extra={"DIST_TIMEOUT_SEC": "60"})
    run.wait_for(STARTED)
    victim = _worker_with_rank(psutil.Process(run.proc.pid), 1)
    killed = time.monotonic()
    victim.kill()
    code = run.wait(timeout=90)
    took = time.monotonic() - killed
    assert code != 0
    assert took < 60, f"the job took {took:.0f} s to end"
    root_cause = run.output.split("Root Cause (first observed failure):")[-1]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root_cause), run.output[-3000:]
    assert re.search(r"exitcode\s*:\s*-9", root_cause)
    assert "Finished" not in run.output
