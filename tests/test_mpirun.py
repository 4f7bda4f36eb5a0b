"""Open MPI for real: `mpirun -np 2 python train.py ...` (the README's command) trains like one
process, as 2-rank torchrun does in tests/test_ddp.py (same losses, same parameters and Adam
moments, the tolerances and reasons given there). The train script does not call MPI itself:
it reads the OMPI_COMM_WORLD_* variables mpirun sets (distributed/launch_env.py) and meets its peers
at MASTER_ADDR:MASTER_PORT (default 127.0.0.1:29500; the test passes a free port with -x).

mpirun comes from Debian's openmpi-bin, installed at test time when it is missing and the
tests run as root (tests/mpi_launcher.py); where that cannot happen the test is skipped with
the reason in the summary, and MPI_TESTS_REQUIRED=1 turns the skip into a failure.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import (
    REPO,
    TINY_ITERS,
    TrainRun,
    assert_completed,
    assert_same_training,
    child_env,
    free_port,
    one_line,
    skip_visibly,
)
from mpi_launcher import MPIUnavailable, find_mpirun, mpirun_command, mpirun_env

from distributed.launch_env import LaunchEnv, resolve_launch_env
from utils.errors import LaunchError

ITERS = TINY_ITERS
TIMEOUT = 300  # seconds for one 2-rank tiny run on a busy 2-core machine (~30 s measured)


# ----------------------------------------------------------------- the environment rules

def test_mpirun_on_one_node_needs_no_master_addr_or_port():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert resolve_launch_env(env) == LaunchEnv(1, 2, 1, "127.0.0.1", 29500, "mpi")


@pytest.mark.parametrize("rank, local", [(0, 0), (1, 1), (2, 0), (3, 1)])
def test_every_rank_of_a_multi_node_mpirun_stops_without_master_addr(rank, local):
    """2 nodes x 2 ranks: the first node's ranks (local rank == rank) stop too, instead of
    waiting for peers that have already exited."""
    env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": str(local), "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(LaunchError) as e:
        resolve_launch_env(env)
    msg = one_line(e)
    assert "MASTER_ADDR" in msg and "mpirun -x MASTER_ADDR=" in msg
    got = resolve_launch_env({**env, "MASTER_ADDR": "nid001", "MASTER_PORT": "29601"})
    assert got == LaunchEnv(rank, 4, local, "nid001", 29601, "mpi")


# ----------------------------------------------------------------- a real mpirun

@pytest.fixture(scope="module")
def mpirun() -> str:
    try:
        return find_mpirun()
    except MPIUnavailable as e:
        skip_visibly("mpirun", f"no Open MPI mpirun on this machine: {e}", "MPI_TESTS_REQUIRED")


def run_mpirun(mpirun: str, nproc: int, tiny_data, log_dir, *flags: str) -> TrainRun:
    """mpirun -np N [-x MASTER_PORT=<free port>] python train.py --config=tiny ..."""
    argv = ["-x", f"MASTER_PORT={free_port()}", sys.executable, "train.py", "--config=tiny",
            f"--num_iters={ITERS}", *flags]
    cmd = mpirun_command(mpirun, nproc, argv)
    env = child_env({"DATA_DIR": tiny_data, "LOG_DIR": log_dir, **mpirun_env()})
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} timed out after {TIMEOUT} s\n{e.stdout}\n{e.stderr}")
    return TrainRun(proc.returncode, proc.stdout, proc.stderr, log_dir, tiny_data, cmd)


@pytest.mark.e2e
def test_mpirun_two_ranks_train_like_one_process(mpirun, serial_reference, tiny_data, tmp_path):
    """Against conftest's `serial_reference`: train.py on one process, global batch 4."""
    run = run_mpirun(mpirun, 2, tiny_data, tmp_path)
    assert_completed(run, ITERS)
    assert "world size 2 (mpi launcher), global batch 4, local batch 2" in run.stdout
    assert_same_training(run, serial_reference, world_size=2)
