"""distributed/launch_env.py: who am I in the job, from torchrun, SLURM (export_DDP_vars.sh),
Open MPI or no launcher at all."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from helpers import REPO, one_line

from distributed.launch_env import LaunchEnv, LaunchError, resolve_launch_env


def one_line_error(env: dict[str, str]) -> str:
    with pytest.raises(LaunchError) as e:
        resolve_launch_env(env)
    return one_line(e)


def test_torchrun_style_environment():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29555"}
    got = resolve_launch_env(env)
    assert got == LaunchEnv(rank=5, world_size=8, local_rank=1, master_addr="10.1.2.3",
                            master_port=29555, launcher="env")
    assert got.distributed


def test_env_style_defaults_local_rank_to_rank_and_master_to_localhost_29500():
    got = resolve_launch_env({"RANK": "0", "WORLD_SIZE": "1"})
    assert got == LaunchEnv(0, 1, 0, "127.0.0.1", 29500, "env")
    assert not got.distributed
    assert resolve_launch_env({"RANK": "2", "WORLD_SIZE": "3"}).local_rank == 2


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_slurm_task_environment_via_export_DDP_vars():
    """Source the real export_DDP_vars.sh in a SLURM-like task environment and resolve
    the variables it exports."""
    slurm = {"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NTASKS": "8",
             "SLURM_JOB_NODELIST": "nid[001234-001235]", "SLURM_JOB_ID": "4242",
             "PATH": "/usr/bin:/bin"}
    script = 'source export_DDP_vars.sh && env -0'
    out = subprocess.run(["bash", "-c", script], cwd=REPO, env=slurm, capture_output=True,
                         text=True, check=True, timeout=30).stdout
    exported = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    assert {k: exported[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")} == \
        {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "MASTER_PORT": str(29500 + 242)}
    got = resolve_launch_env(exported)
    assert got == LaunchEnv(6, 8, 2, "nid001234", 29742, "env")


def test_open_mpi_style_environment():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "1234"}
    assert resolve_launch_env(env) == LaunchEnv(3, 4, 1, "node0", 1234, "mpi")


def test_open_mpi_on_one_node_needs_no_master_addr():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert resolve_launch_env(env) == LaunchEnv(1, 2, 1, "127.0.0.1", 29500, "mpi")


def test_open_mpi_across_nodes_without_master_addr_is_an_error():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert "MASTER_ADDR" in one_line_error(env)


def test_torchrun_variables_take_precedence_over_open_mpi():
    env = {"RANK": "1", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0",
           "OMPI_COMM_WORLD_SIZE": "2"}
    got = resolve_launch_env(env)
    assert (got.rank, got.launcher) == (1, "env")


def test_no_launcher_is_a_single_process():
    got = resolve_launch_env({})
    assert got == LaunchEnv(0, 1, 0, "127.0.0.1", 29500, "none")
    assert not got.distributed


def test_reads_os_environ_by_default(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resolve_launch_env().rank == 1


@pytest.mark.parametrize("env, words", [
    ({"RANK": "0"}, ["WORLD_SIZE", "RANK"]),
    ({"WORLD_SIZE": "2"}, ["RANK", "WORLD_SIZE"]),
    ({"RANK": "4", "WORLD_SIZE": "4"}, ["rank 4", "world size 4"]),
    ({"RANK": "-1", "WORLD_SIZE": "4"}, ["rank -1"]),
    ({"RANK": "0", "WORLD_SIZE": "0"}, ["world size 0"]),
    ({"RANK": "one", "WORLD_SIZE": "2"}, ["RANK", "'one'", "integer"]),
    ({"RANK": "0", "WORLD_SIZE": "2.0"}, ["WORLD_SIZE", "'2.0'"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, ["LOCAL_RANK", "'x'"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, ["MASTER_PORT", "'http'"]),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2"}, ["local rank 2", "rank 1"]),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "4"}, ["rank 5", "world size 4"]),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "n"}, ["OMPI_COMM_WORLD_SIZE"]),
])
def test_bad_launch_environments_are_one_line_LaunchErrors(env, words):
    msg = one_line_error(env)
    for word in words:
        assert word in msg, (word, msg)


def test_open_mpi_rank_without_size_is_a_LaunchError_not_a_KeyError():
    """A partial Open MPI environment is a user-facing error like the torchrun one."""
    assert "OMPI_COMM_WORLD_SIZE" in one_line_error({"OMPI_COMM_WORLD_RANK": "0"})
