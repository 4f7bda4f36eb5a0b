"""The README's spatial-parallel commands reach train_mp.py through submit_pm_mp.sh.

  - without a cluster: submit_pm_mp.sh run as a batch script with a stand-in `srun` that
    reports its command line: the README's `--config=afno --h_parallel_size=4` arrives at
    train_mp.py verbatim;
  - with a real SLURM cluster on this machine (tests/slurm_cluster.py; skipped with the
    reason where it cannot run): 4 tasks train tiny_afno on a 2 x 2 mesh.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import slurm_job_output, start_slurm_cluster

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
BASH = shutil.which("bash") or "/bin/bash"
README_ARGS = ["--config=afno", "--h_parallel_size=4"]
STAND_IN_SRUN = f"""#!{sys.executable}
import json, sys
print("SRUN " + json.dumps(sys.argv[1:]))
"""


def test_submit_pm_mp_passes_the_mesh_flags_to_train_mp(tmp_path: Path) -> None:
    tools = tmp_path / "bin"
    tools.mkdir()
    srun = tools / "srun"
    srun.write_text(STAND_IN_SRUN)
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": f"{tools}:/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path),
           "SITE": "generic", "PYTHON": "python3", "LOG_DIR": str(tmp_path / "logs"),
           "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_ID": "12", "SLURM_NTASKS": "16"}
    r = subprocess.run([BASH, "submit_pm_mp.sh", *README_ARGS], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("SRUN "))
    argv = json.loads(line.split(" ", 1)[1])
    # srun [site args] bash -c <task> task <script> <arguments>
    assert argv[-3:] == ["train_mp.py", *README_ARGS], argv
    assert "--kill-on-bad-exit=1" in argv


@pytest.mark.slurm
@pytest.mark.distributed
def test_a_slurm_job_trains_the_afno_on_a_2x2_mesh(tiny_data: Path, tmp_path: Path) -> None:
    cluster = start_slurm_cluster(nodes=1)
    try:
        env: dict[str, str | None] = {k: None for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                        "MASTER_PORT", "TRAIN_SCRIPT")}
        env.update(SITE="generic", PYTHON=sys.executable, DATA_DIR=str(tiny_data),
                   LOG_DIR=str(tmp_path / "logs"), OMP_NUM_THREADS="1")
        args = ["--config=tiny_afno", "--num_iters=8", "--h_parallel_size=2",
                "--w_parallel_size=2"]
        job = cluster.submit("submit_pm_mp.sh", args, env=env, cwd=str(REPO),
                             sbatch_opts=["-N", "1", "--ntasks-per-node=4",
                                          f"--output={tmp_path}/%x-%j.out"])
        out = slurm_job_output(cluster, job, timeout=240)
    finally:
        cluster.stop()
    assert "train_mp.py " + " ".join(args) in out
    assert "Layout: DP = 1, TP = 1, CP = 1, H = 2, W = 2 (order tp-cp-h-w-ens-dp)" in out
    assert "Finished 8 iterations" in out
    run = tmp_path / "logs" / "tiny_afno" / "4CPU" / f"job{job}-h_parallel_size=2-w_parallel_size=2"
    assert os.path.isdir(run / "checkpoints")
