"""The rendezvous on a real SLURM cluster whose node names are not host names: two nodes
`node1`, `node2` (NodeHostname = this machine, NodeAddr = 127.0.0.1, as cloud and container
clusters are configured), where `node1` does not resolve.

  - `sbatch -N 2 --ntasks-per-node=1 submit_pm_dp.sh --config=tiny` with the generic preset
    and no rendezvous variable completes: export_DDP_vars.sh takes the first node's NodeAddr;
  - the same job with DDP_MASTER_ADDR set to a name that does not resolve fails with exactly
    one `error:` line naming the host, the port and DDP_MASTER_ADDR, in seconds: its connect
    timeout is set to 10 minutes, so only the resolution check can end it that soon.

One cluster for the module; the two jobs run side by side. Skipped, with the reason printed,
where a private SLURM cluster cannot run; SLURM_TESTS_REQUIRED=1 turns that into a failure.
"""

from __future__ import annotations

import re
import socket
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
from helpers import (
    REPO,
    SLURM_LEAKY_VARS,
    generic_job_env,
    slurm_job_output,
    start_slurm_cluster,
)
from slurm_cluster import SlurmCluster, parse_fields

from distributed.rendezvous import RESOLVE_TIMEOUT_SEC

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

JOB_TIMEOUT = 300  # seconds for a 2-task tiny job on a loaded 2-core machine (~40 s idle)
UNRESOLVABLE = "no-such-node.invalid"
# A job start (srun, two Python interpreters importing torch) on a loaded 2-core machine;
# the failing job must end within this plus the resolution bound.
STARTUP_ALLOWANCE = 90.0


@pytest.fixture(scope="module")
def cluster():
    c = start_slurm_cluster(nodes=2)
    yield c
    c.stop()


def _env(workdir: Path, data: Path, name: str, **extra: str) -> dict[str, str | None]:
    """What a user exports on a generic cluster: the generic preset, a python, data and
    log directories; nothing about the rendezvous."""
    return generic_job_env(DATA_DIR=str(data), LOG_DIR=str(workdir / name),
                           OMP_NUM_THREADS="1", **extra)


@pytest.fixture(scope="module")
def jobs(cluster: SlurmCluster, tiny_data: Path, tmp_path_factory) -> dict[str, int]:
    workdir = tmp_path_factory.mktemp("rendezvous-jobs")
    opts = ["-N", "2", "--ntasks-per-node=1", f"--output={workdir}/%x-%j.out"]
    return {
        "plain": cluster.submit("submit_pm_dp.sh", ["--config=tiny"], cwd=str(REPO),
                                env=_env(workdir, tiny_data, "plain"), sbatch_opts=opts),
        "unresolvable": cluster.submit(
            "submit_pm_dp.sh", ["--config=tiny"], cwd=str(REPO), sbatch_opts=opts,
            env=_env(workdir, tiny_data, "unresolvable", DDP_MASTER_ADDR=UNRESOLVABLE,
                     DIST_CONNECT_TIMEOUT_SEC="600")),
    }


def _node_addr(cluster: SlurmCluster, node: str) -> str:
    info = parse_fields(cluster.run(["scontrol", "show", "node", node, "-o"]).stdout)
    return info["NodeAddr"]


def test_a_two_node_job_meets_at_the_first_nodes_address_with_no_extra_variable(cluster,
                                                                                 jobs):
    first = cluster.node_names[0]
    with pytest.raises(OSError):  # what makes this cluster a test: the name is no host name
        socket.getaddrinfo(first, None)
    out = slurm_job_output(cluster, jobs["plain"], JOB_TIMEOUT)
    tasks = re.findall(r"task RANK=(\d) LOCAL_RANK=0 WORLD_SIZE=2 MASTER_ADDR=(\S+) "
                       r"MASTER_PORT=\d+ host=\S+ node=(\d)", out)
    assert sorted(tasks) == [("0", _node_addr(cluster, first), "0"),
                             ("1", _node_addr(cluster, first), "1")], out[-3000:]
    assert "world size 2 (env launcher)" in out, out[-3000:]
    assert "Finished 16 iterations" in out, out[-3000:]
    assert "error:" not in out and "[W" not in out, out[-3000:]


def _seconds(info: dict[str, str]) -> float:
    start, end = (datetime.fromisoformat(info[k]) for k in ("StartTime", "EndTime"))
    return (end - start).total_seconds()


def test_an_unresolvable_ddp_master_addr_fails_in_seconds_with_one_line(cluster, jobs):
    job = jobs["unresolvable"]
    try:
        state, code = cluster.wait(job, timeout=JOB_TIMEOUT)
    except TimeoutError as e:
        pytest.fail(f"{e}\n{cluster.output(job)[-4000:]}")
    out = cluster.output(job)
    assert state == "FAILED" and code == 2, f"{state} {code}\n{out[-3000:]}"
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    for word in (f"MASTER_ADDR={UNRESOLVABLE}", "does not resolve", "set DDP_MASTER_ADDR",
                 "SITE_MASTER_IFACE"):
        assert word in errors[0], (word, errors[0])
    assert re.search(r"\(port \d+\)", errors[0]), errors[0]
    for noise in ("Traceback", "frame #", "[W", "[E", "cannot be retrieved"):
        assert noise not in out, (noise, out[-3000:])
    seconds = _seconds(cluster.job_info(job) or {})
    print(f"unresolvable DDP_MASTER_ADDR: the job ended {seconds:.0f} s after it started "
          "(start-up included)")
    assert seconds < STARTUP_ALLOWANCE + RESOLVE_TIMEOUT_SEC


def _master_addr(cluster: SlurmCluster, nodelist: str) -> str:
    """MASTER_ADDR as export_DDP_vars.sh sets it for a task of a job on `nodelist`."""
    env = {k: v for k, v in cluster.env.items() if k not in SLURM_LEAKY_VARS}
    env.update(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_JOB_NODELIST=nodelist)
    done = subprocess.run(["bash", "-c", 'source ./export_DDP_vars.sh && echo "$MASTER_ADDR"'],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_export_ddp_vars_asks_scontrol_only_for_a_name_that_does_not_resolve(cluster):
    first = cluster.node_names[0]
    assert _master_addr(cluster, f"{first},{cluster.node_names[1]}") == \
        _node_addr(cluster, first) != first
    assert _master_addr(cluster, "localhost") == "localhost"  # resolves: kept as it is
