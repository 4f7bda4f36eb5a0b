"""Open MPI's mpirun for the tests, installed the way tests/slurm_cluster.py installs SLURM.

    mpirun = find_mpirun()        # installs Debian's openmpi-bin when missing (root + apt)
    cmd = mpirun_command(mpirun, 2, [sys.executable, "train.py", ...])

find_mpirun() raises MPIUnavailable with the reason when mpirun cannot be had here (not root,
no apt-get, no package access, not Open MPI); the caller turns that into a visible skip.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence

from slurm_cluster import _path, _which

PACKAGES = ("openmpi-bin",)


class MPIUnavailable(RuntimeError):
    """Open MPI's mpirun cannot run here; the message says why."""


def _apt_install(timeout: float, log=print) -> None:
    if _which("apt-get") is None:
        raise MPIUnavailable("no mpirun, and no apt-get to install openmpi-bin")
    if os.geteuid() != 0:
        raise MPIUnavailable("no mpirun, and not root: apt-get install openmpi-bin")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", PATH=_path())
    deadline = time.monotonic() + timeout
    log(f"mpi_launcher: installing {' '.join(PACKAGES)}")
    install = ["apt-get", "-q", "-y", "-o", "DPkg::Lock::Timeout=60", "install",
               "--no-install-recommends", *PACKAGES]
    # Try without `apt-get update` first (the SLURM tests may have refreshed the lists).
    for cmd in (install, ["apt-get", "-q", "-o", "DPkg::Lock::Timeout=60", "update"], install):
        left = deadline - time.monotonic()
        try:
            r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, timeout=max(left, 1.0))
        except subprocess.TimeoutExpired:
            raise MPIUnavailable(f"`{' '.join(cmd[:5])}` took over {timeout:.0f} s "
                                 "(no package access?)") from None
        if r.returncode == 0 and cmd is install and _which("mpirun"):
            return
        tail = " | ".join(r.stdout.strip().splitlines()[-2:])
    raise MPIUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {tail}")


def find_mpirun(timeout: float = 300.0) -> str:
    """Path of Open MPI's mpirun, installing openmpi-bin with apt-get when it is missing."""
    if _which("mpirun") is None:
        _apt_install(timeout)
    path = _which("mpirun")
    if path is None:
        raise MPIUnavailable("mpirun still missing after installing openmpi-bin")
    r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    if "Open MPI" not in r.stdout + r.stderr:
        raise MPIUnavailable(f"{path} is not Open MPI's: {(r.stdout + r.stderr).strip()[:200]}")
    return path


def mpirun_command(mpirun: str, nproc: int, argv: Sequence[str]) -> list[str]:
    """`mpirun -np N argv...` on this machine: as root when the tests run as root, more
    ranks than cores allowed, no core binding (other jobs share the cores), and the
    environment of the caller (Open MPI passes it to ranks on the local node)."""
    cmd = [mpirun, "-np", str(nproc), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return [*cmd, *argv]


def mpirun_env() -> dict[str, str]:
    """Variables Open MPI needs here (root is refused without both)."""
    if os.geteuid() == 0:
        return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return {}
