"""The rendezvous before torch.distributed starts (distributed/rendezvous.py), with real processes:
a MASTER_ADDR that does not resolve, a port nobody listens on, ranks that never arrive, a
port already taken and a MASTER_ADDR of another host each end with one `error:` line that
names the host, the port and the variable to set, within a bound measured here; no warning,
no C++ stack trace. The time is measured from the moment a process has imported torch and
the project (start-up is not the rendezvous, and this machine may be busy) to its exit.

The happy paths are the multi-process tests of the train scripts (tests/test_mpirun.py,
tests/test_errors.py, tests/test_ddp.py under torchrun) and the SLURM jobs
(tests/test_slurm_rendezvous.py, with node names that are not host names).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest
from helpers import REPO, child_env, free_port, one_line, skip_visibly
from slurm_cluster import KILL_WAIT

from distributed.rendezvous import (
    DEFER_MARGIN_SEC,
    RELEASE_GRACE_SEC,
    RESOLVE_TIMEOUT_SEC,
    SELF_CHECK_SEC,
    RendezvousError,
    Timeouts,
    resolve,
    timeouts,
    what_to_set,
)
from training import signals
from training.script_exit import LINGER, linger
from utils.errors import LaunchError

UNRESOLVABLE = "no-such-node.invalid"  # .invalid never resolves (RFC 2606)
SLACK = 10.0  # seconds for an interpreter to print and exit on a busy 2-core machine
CONNECT = 3.0  # DIST_CONNECT_TIMEOUT_SEC in these tests
# A rank of a job, as the train scripts start one: run_main(comm.init_process). "ready"
# marks the end of the imports, where the clock starts.
DRIVER = ("from distributed import comm\nfrom training.script_exit import run_main\n"
          "print('ready', flush=True)\nrun_main(lambda argv: comm.init_process(), [])\n")


# ----------------------------------------------------------------------------- unit

def test_timeouts_default_to_60_s_to_connect_and_300_s_per_collective():
    assert timeouts({}) == Timeouts(connect=60.0, collective=300.0)
    assert timeouts({"DIST_CONNECT_TIMEOUT_SEC": "2.5", "DIST_TIMEOUT_SEC": "30"}) == \
        Timeouts(connect=2.5, collective=30.0)


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan"])
def test_a_bad_timeout_is_a_one_line_launch_error(value):
    with pytest.raises(LaunchError) as e:
        timeouts({"DIST_CONNECT_TIMEOUT_SEC": value})
    assert f"DIST_CONNECT_TIMEOUT_SEC={value!r}" in one_line(e)


def test_the_variable_to_set_depends_on_the_launcher():
    assert "DDP_MASTER_ADDR" in what_to_set({"SLURM_JOB_ID": "12", "RANK": "0"})
    assert "SITE_MASTER_IFACE" in what_to_set({"SLURM_JOB_ID": "12"})
    assert "mpirun -x MASTER_ADDR=" in what_to_set({"OMPI_COMM_WORLD_RANK": "0"})
    assert "set MASTER_ADDR" in what_to_set({"RANK": "0"})


def test_resolve_gives_numeric_addresses():
    assert "127.0.0.1" in resolve("127.0.0.1", 29500)
    assert set(resolve("localhost", 29500)) & {"127.0.0.1", "::1"}


def test_a_name_that_does_not_resolve_is_one_line_naming_host_and_port():
    started = time.monotonic()
    with pytest.raises(RendezvousError) as e:
        resolve(UNRESOLVABLE, 29555)
    assert time.monotonic() - started < RESOLVE_TIMEOUT_SEC + 1
    assert f"MASTER_ADDR={UNRESOLVABLE} (port 29555) does not resolve" in one_line(e)


# ----------------------------------------------------------------------------- processes

@dataclass
class Rank:
    returncode: int
    stderr: str
    stdout: str
    seconds: float  # from "ready" (imports done) to exit
    ended: float    # time.monotonic() at exit


def _start(rank: int, world: int, addr: str, port: int,
           driver: str = DRIVER) -> subprocess.Popen:
    env = child_env({"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world,
                     "MASTER_ADDR": addr, "MASTER_PORT": port,
                     "DIST_CONNECT_TIMEOUT_SEC": CONNECT})
    return subprocess.Popen([sys.executable, "-c", driver], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen, timeout: float = 180) -> Rank:
    first = proc.stdout.readline()  # blocks until the imports are done
    started = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"no exit within {timeout} s:\n{out}\n{err}")
    ended = time.monotonic()
    assert first.strip() == "ready", first + out + err
    return Rank(proc.returncode, err, out, ended - started, ended)


def _the_one_line(rank: Rank, *words: str) -> str:
    """Exit 2, and stderr is exactly one `error:` line naming `words`: no warning, no C++
    stack trace, no traceback."""
    lines = [line for line in rank.stderr.splitlines() if line.strip()]
    assert rank.returncode == 2 and len(lines) == 1, rank.stderr[-3000:]
    assert lines[0].startswith("error: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]



@pytest.mark.distributed
@pytest.mark.e2e
def test_ranks_meet_and_say_nothing():
    port = free_port()
    procs = [_start(r, 3, "localhost", port) for r in range(3)]
    ranks = [_finish(p) for p in procs]
    for r, rank in enumerate(ranks):
        assert rank.returncode == 0, f"rank {r}: {rank.stderr[-3000:]}"
        assert rank.stderr.strip() == "", f"rank {r}: {rank.stderr[-3000:]}"


@pytest.mark.distributed
@pytest.mark.e2e
def test_an_unresolvable_master_addr_ends_rank_0_within_seconds_with_one_line():
    """Rank 0 reports at once; rank 1 stays silent while rank 0 may still be reporting (a
    launcher ends it when rank 0 exits: tests/test_slurm_rendezvous.py), and only then says
    it itself, as a rank that is still running."""
    port = free_port()
    procs = [_start(r, 2, UNRESOLVABLE, port) for r in range(2)]
    rank0, rank1 = (_finish(p) for p in procs)
    _the_one_line(rank0, f"MASTER_ADDR={UNRESOLVABLE}", f"port {port}", "does not resolve",
                  "set MASTER_ADDR")
    assert not rank0.stderr.startswith("error: rank 0:")  # the job's line, not a rank's
    print(f"unresolvable MASTER_ADDR: rank 0 exited {rank0.seconds:.1f} s after its imports")
    assert rank0.seconds < RESOLVE_TIMEOUT_SEC + SLACK
    _the_one_line(rank1, "error: rank 1: ", f"MASTER_ADDR={UNRESOLVABLE}")
    assert rank1.ended > rank0.ended


def test_a_quiet_rank_that_a_stop_signal_reached_does_not_linger(monkeypatch):
    monkeypatch.setattr(signals, "_received", signal.SIGTERM)  # as the handler records it
    started = time.monotonic()
    linger()
    assert time.monotonic() - started < LINGER / 10


def test_a_stop_signal_while_a_quiet_rank_lingers_ends_the_wait(monkeypatch):
    monkeypatch.setattr(signals, "_received", None)  # restored after the test
    threading.Timer(0.2, signals._record, (signal.SIGTERM, None)).start()
    started = time.monotonic()
    linger()
    assert time.monotonic() - started < LINGER / 2


@pytest.mark.distributed
@pytest.mark.e2e
def test_a_silent_rank_the_launcher_stops_exits_2_quietly_before_sigkill():
    """What srun --kill-on-bad-exit does once rank 0 has reported: SIGTERM to the ranks
    still running, SIGKILL KillWait seconds later. The silent rank must be gone before
    that: exit 2, not 137 (the job's exit code is the highest of its tasks')."""
    # As the train scripts start: stop signals are caught from the first line on.
    driver = "from training import signals\nsignals.stop_during_startup()\n" + DRIVER
    proc = _start(1, 2, UNRESOLVABLE, free_port(), driver)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(3.0)  # the name fails to resolve in milliseconds; the rank is deferring
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    out, err = proc.communicate(timeout=60)
    seconds = time.monotonic() - signalled
    print(f"a silent rank stopped by SIGTERM exited {seconds:.2f} s later")
    assert proc.returncode == 2 and err.strip() == "", (proc.returncode, err[-3000:])
    assert seconds < KILL_WAIT  # the private SLURM cluster's (tests/slurm_cluster.py)


@pytest.mark.distributed
@pytest.mark.e2e
def test_a_port_nobody_listens_on_fails_within_the_connect_timeout():
    """Rank 1 of 2, rank 0 never started: rank 1 tries for DIST_CONNECT_TIMEOUT_SEC, then
    leaves rank 0 DEFER_MARGIN_SEC to report first, then reports it itself."""
    port = free_port()
    rank1 = _finish(_start(1, 2, "127.0.0.1", port))
    _the_one_line(rank1, f"nothing listens at MASTER_ADDR=127.0.0.1:{port}",
                  f"after {CONNECT:g} s (DIST_CONNECT_TIMEOUT_SEC)")
    print(f"port nobody listens on: rank 1 exited {rank1.seconds:.1f} s after its imports "
          f"(DIST_CONNECT_TIMEOUT_SEC={CONNECT:g})")
    assert CONNECT <= rank1.seconds < CONNECT + DEFER_MARGIN_SEC + SLACK


@pytest.mark.distributed
@pytest.mark.e2e
def test_rank_0_names_the_ranks_that_never_arrive_after_the_connect_timeout():
    port = free_port()
    rank0 = _finish(_start(0, 3, "127.0.0.1", port))
    _the_one_line(rank0, f"ranks 1, 2 did not reach MASTER_ADDR=127.0.0.1:{port}",
                  "DIST_CONNECT_TIMEOUT_SEC")
    assert CONNECT <= rank0.seconds < CONNECT + RELEASE_GRACE_SEC + SLACK


@pytest.mark.distributed
@pytest.mark.e2e
def test_a_taken_port_is_named_by_rank_0_at_once():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rank0 = _finish(_start(0, 2, "127.0.0.1", port))
    _the_one_line(rank0, f"MASTER_PORT={port}", "set MASTER_PORT to a free port")
    assert rank0.seconds < SLACK


def _an_address_of_another_host() -> str:
    """The default gateway's address (another host on the network), else a documentation
    address (RFC 5737) that no host of this machine has."""
    try:
        with open("/proc/net/route") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[1] == "00000000" and fields[2] != "00000000":
                    return socket.inet_ntoa(bytes.fromhex(fields[2])[::-1])
    except (OSError, IndexError, ValueError):
        pass
    return "198.51.100.7"


@pytest.mark.distributed
@pytest.mark.e2e
def test_a_master_addr_of_another_host_fails_on_rank_0_in_seconds():
    """Rank 0 checks that MASTER_ADDR leads back to itself, instead of every rank waiting
    for a store nobody hosts."""
    other = _an_address_of_another_host()
    rank0 = _finish(_start(0, 2, other, free_port()))
    _the_one_line(rank0, f"MASTER_ADDR={other}", "is not the host of rank 0")
    assert rank0.seconds < SELF_CHECK_SEC + SLACK


@pytest.mark.distributed
@pytest.mark.e2e
def test_an_mpirun_job_with_an_unresolvable_master_addr_prints_one_line(tiny_data, tmp_path):
    """A real launcher: mpirun ends rank 1 when rank 0 exits, so the job's whole output
    holds rank 0's line alone."""
    from mpi_launcher import MPIUnavailable, find_mpirun, mpirun_command, mpirun_env

    try:
        mpirun = find_mpirun()
    except MPIUnavailable as e:
        skip_visibly("mpirun", f"no Open MPI mpirun on this machine: {e}", "MPI_TESTS_REQUIRED")
    argv = ["-x", f"MASTER_ADDR={UNRESOLVABLE}", "-x", f"MASTER_PORT={free_port()}",
            sys.executable, "train.py", "--config=tiny"]
    env = child_env({"DATA_DIR": tiny_data, "LOG_DIR": tmp_path, **mpirun_env()})
    done = subprocess.run(mpirun_command(mpirun, 2, argv), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert done.returncode != 0 and len(errors) == 1, output[-3000:]
    assert f"MASTER_ADDR={UNRESOLVABLE}" in errors[0] and "mpirun -x MASTER_ADDR=" in errors[0]
    assert "Traceback" not in output and "frame #" not in output and "[W" not in output
