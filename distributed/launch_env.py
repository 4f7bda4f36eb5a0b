"""Who am I in the job? Rank, world size and rendezvous from the launcher's environment.

Understood launchers, in order of precedence:
  torchrun / SLURM via export_DDP_vars.sh : RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
  Open MPI (mpirun)                        : OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK
  nothing                                  : a single process (rank 0 of 1)

Rendezvous: MASTER_ADDR (default 127.0.0.1) and MASTER_PORT (default 29500). mpirun on one
node needs neither; across nodes MASTER_ADDR is required (`mpirun -x MASTER_ADDR=...`), and
two jobs sharing a node need different MASTER_PORTs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from utils.errors import LaunchError


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "env" (torchrun/SLURM), "mpi" or "none"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _int(environ: Mapping[str, str], key: str) -> int:
    if key not in environ:
        raise LaunchError(f"{key} is not set")
    try:
        return int(environ[key])
    except ValueError:
        raise LaunchError(f"{key}={environ[key]!r} is not an integer") from None


def resolve_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in env]
        if missing:
            raise LaunchError(f"{missing[0]} is not set but "
                              f"{'WORLD_SIZE' if missing[0] == 'RANK' else 'RANK'} is: "
                              "set both (torchrun and export_DDP_vars.sh do)")
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        launcher = "env"
    elif "OMPI_COMM_WORLD_RANK" in env:
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env \
            else rank
        launcher = "mpi"
    else:
        rank, world, local, launcher = 0, 1, 0, "none"
    if world < 1:
        raise LaunchError(f"world size {world} must be >= 1")
    if not 0 <= rank < world:
        raise LaunchError(f"rank {rank} is outside world size {world}")
    if not 0 <= local <= rank:
        raise LaunchError(f"local rank {local} is inconsistent with rank {rank}")
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500
    if launcher == "mpi" and "MASTER_ADDR" not in env and _mpi_spans_nodes(env, rank, local):
        raise LaunchError("mpirun across nodes needs MASTER_ADDR, the first node's address: "
                          "mpirun -x MASTER_ADDR=<host> -x MASTER_PORT=<port> ...")
    return LaunchEnv(rank, world, local, addr, port, launcher)


def _mpi_spans_nodes(env: Mapping[str, str], rank: int, local: int) -> bool:
    """Whether an mpirun job has ranks on more than one node. Every rank can tell from
    OMPI_COMM_WORLD_LOCAL_SIZE < OMPI_COMM_WORLD_SIZE, so all of them stop with the same
    error (rank 0 would otherwise wait for its peers until the rendezvous timeout)."""
    local_size, world = env.get("OMPI_COMM_WORLD_LOCAL_SIZE", ""), env["OMPI_COMM_WORLD_SIZE"]
    if local_size.isdigit() and world.isdigit() and int(local_size) < int(world):
        return True
    return local != rank


def slurm_restarts(environ: Mapping[str, str] | None = None) -> int:
    """How often SLURM has requeued this job (SLURM_RESTART_COUNT; 0: the first run)."""
    env = os.environ if environ is None else environ
    return int(env.get("SLURM_RESTART_COUNT", "0") or 0)
