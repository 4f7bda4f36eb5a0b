"""The SLURM submit scripts, for real: a private SLURM cluster on this machine
(tests/slurm_cluster.py) runs submit_pm.sh, submit_pm_dp.sh (2 tasks) and submit_pm_mp.sh
(tp 2) with the generic site preset on a tiny synthetic dataset, a preempted job that
checkpoints, requeues itself and resumes, and submit_pm_mp.sh on two nodes with a probe
script; plus checks that need no cluster (export_DDP_vars.sh, the portability of the
#SBATCH lines, the site presets and how one is chosen).

The cluster needs root and the Debian packages slurmctld, slurmd, slurm-client and munge
(installed with apt-get when missing). Where it cannot exist the cluster tests are skipped
with the reason in the test summary; SLURM_TESTS_REQUIRED=1 turns that skip into a failure.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import (
    REPO,
    generic_job_env,
    slurm_job_output,
    srun_on_two_nodes,
    start_slurm_cluster,
)
from slurm_cluster import SlurmCluster, parse_fields

SCRIPTS = ("submit_pm.sh", "submit_pm_dp.sh", "submit_pm_mp.sh")
JOB_TIMEOUT = 240  # seconds for one tiny training job on a 2-core machine (~15-35 s measured)
BASH = shutil.which("bash") or "/bin/bash"


def _bash(script: str, env: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([BASH, "-c", script], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=30)


def _vars(stdout: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in stdout.splitlines() if "=" in line)


# --------------------------------------------------------------------------- no cluster
DDP_PRINT = "source ./export_DDP_vars.sh; for v in RANK LOCAL_RANK WORLD_SIZE MASTER_ADDR " \
            "MASTER_PORT; do echo \"$v=${!v}\"; done"


@pytest.mark.parametrize("tools", ["path", "pure-bash"])
def test_export_ddp_vars(tools, tmp_path):
    """The SLURM task variables become torch.distributed's, with or without SLURM tools."""
    path = str(tmp_path) if tools == "pure-bash" else os.environ.get("PATH", "/usr/bin:/bin")
    env = {"PATH": path, "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
           "SLURM_JOB_NODELIST": "nid[001234-001237]"}
    r = _bash(DDP_PRINT, env)
    assert r.returncode == 0, r.stderr
    assert _vars(r.stdout) == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                               "MASTER_ADDR": "nid001234", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("nodelist, first", [
    ("host", "host"), ("hosta,hostb", "hosta"), ("host[1-4]", "host1"),
    ("host[01,03]", "host01"), ("nid[001234-001237,001240]", "nid001234"),
    ("gpu[07-09]-ib,login1", "gpu07-ib"), ("nid001000", "nid001000"),
])
def test_export_ddp_vars_nodelist_forms(nodelist, first, tmp_path):
    """The pure-bash fallback (no scontrol, e.g. inside a container) finds the first host."""
    env = {"PATH": str(tmp_path), "SLURM_NODELIST": nodelist, "SLURM_PROCID": "0",
           "SLURM_NTASKS": "2"}
    r = _bash(DDP_PRINT, env)
    assert _vars(r.stdout)["MASTER_ADDR"] == first, r.stderr


def test_export_ddp_vars_port_and_overrides(tmp_path):
    base = {"PATH": str(tmp_path), "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "a[1-2]", "SLURM_JOB_ID": "123456"}
    # a per-job default port, so two jobs sharing a node do not collide
    assert _vars(_bash(DDP_PRINT, base).stdout)["MASTER_PORT"] == str(29500 + 456)
    out = _vars(_bash(DDP_PRINT, dict(base, MASTER_PORT="40000",
                                      DDP_MASTER_ADDR="10.1.2.3")).stdout)
    assert (out["MASTER_PORT"], out["MASTER_ADDR"]) == ("40000", "10.1.2.3")


def _sbatch_options(script: Path) -> list[tuple[int, str]]:
    """(line number, option name) of every option on the script's #SBATCH lines."""
    found = []
    for number, line in enumerate(script.read_text().splitlines(), 1):
        if not line.startswith("#SBATCH"):
            continue
        for token in shlex.split(line[len("#SBATCH"):], comments=True):
            if token.startswith("--"):
                found.append((number, token.split("=", 1)[0]))
            elif token.startswith("-"):
                found.append((number, token[:2]))  # -C gpu, -Cgpu
    return found


# Rejected by sbatch on a cluster without the feature/GRES/plugin (-C, --gpus*, --gres,
# Shifter's --image/--module), or meaningful only at one site (-A, -q, -p, reservations,
# CPU counts that exceed other machines' nodes). These belong in site/<name>.sh.
NOT_PORTABLE = re.compile(r"^(-C|--constraint|-G|--gpus.*|--gres.*|--image|--module|--volume|"
                          r"-A|--account|-q|--qos|-p|--partition|--reservation|-L|--licenses|"
                          r"-c|--cpus-per-task|--cpu-bind|--mem.*)$")


@pytest.mark.parametrize("name", SCRIPTS)
def test_sbatch_lines_are_portable(name):
    script = REPO / name
    options = _sbatch_options(script)
    assert options, f"{name} has no #SBATCH lines"
    bad = [f"{name}:{n}: {opt}" for n, opt in options if NOT_PORTABLE.match(opt)]
    assert not bad, "site-specific #SBATCH options (set them in site/<name>.sh): " + \
        ", ".join(bad)
    assert {"--output", "-o"} & {opt for _, opt in options}, f"{name}: no --output"
    r = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _preset_env(script: str, **extra: str) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", **extra}
    r = _bash(script + "; env", env)
    assert r.returncode == 0, r.stderr
    return _vars(r.stdout)


def test_site_presets():
    pm = _preset_env("source site/perlmutter.sh", SCRATCH="/scratch")
    assert pm["SITE"] == "perlmutter"
    assert (pm["SBATCH_CONSTRAINT"], pm["SBATCH_QOS"], pm["SBATCH_GPUS_PER_NODE"]) == \
        ("gpu", "regular", "4")
    assert "shifter --image=nvcr.io/nvidia/pytorch:25.12-py3 --module=gpu,nccl-plugin" in \
        pm["SITE_LAUNCHER"]
    assert pm["SLURM_CPU_BIND"] == "cores" and pm["SITE_CUDA_VISIBLE_DEVICES"] == "3,2,1,0"
    assert pm["NCCL_NET_GDR_LEVEL"] == "PHB" and pm["DATA_DIR"].startswith("/scratch/")
    # values already in the environment win over the preset's defaults
    assert _preset_env("source site/perlmutter.sh", SBATCH_QOS="debug")["SBATCH_QOS"] == "debug"

    gen = _preset_env("source site/generic.sh", PYTHON="/opt/py/bin/python")
    assert gen["SITE"] == "generic" and gen["PYTHON"] == "/opt/py/bin/python"
    assert not [k for k in gen if k.startswith("SBATCH_")], "generic sets sbatch options"
    assert gen["SITE_LAUNCHER"] == "" and gen["LOG_DIR"] == str(REPO / "logs")


def test_site_selection(tmp_path):
    """SITE wins, then site/local.sh, then NERSC_HOST=perlmutter, else generic."""
    site = tmp_path / "site"
    shutil.copytree(REPO / "site", site)
    load = f"source {site}/load.sh"
    assert _preset_env(load)["SITE"] == "generic"
    assert _preset_env(load, NERSC_HOST="perlmutter")["SITE"] == "perlmutter"
    assert _preset_env(load, NERSC_HOST="perlmutter", SITE="generic")["SITE"] == "generic"
    (site / "local.sh").write_text((site / "generic.sh").read_text())
    assert _preset_env(load, NERSC_HOST="perlmutter")["SITE"] == "local"
    r = _bash(load, {"PATH": os.environ.get("PATH", ""), "SITE": "nowhere"})
    assert r.returncode != 0 and "no preset" in r.stderr


# --------------------------------------------------------------------------- cluster
@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("slurm-jobs")


def _job_env(cluster: SlurmCluster, workdir: Path, **extra: str) -> dict[str, str | None]:
    """The generic preset's environment, logs under `workdir` (helpers.generic_job_env)."""
    return generic_job_env(**{"LOG_DIR": str(workdir / "logs"), **extra})


def _out_opt(workdir: Path) -> str:
    return f"--output={workdir}/%x-%j.out"


PREEMPT_ITERS = 40  # 5 epochs: the signal lands long before the end, even on a busy machine


@pytest.fixture(scope="module")
def training_jobs(cluster, tiny_data, workdir):
    """All training jobs, submitted together so that they overlap (6 of the node's 8 slots):
    the tests then only wait for them."""
    def env(name: str) -> dict[str, str | None]:  # one log directory per job
        return _job_env(cluster, workdir, DATA_DIR=str(tiny_data),
                        LOG_DIR=str(workdir / "logs" / name))

    two_tasks = ["-N", "1", "--ntasks-per-node=2", _out_opt(workdir)]
    # dp and mp share the node at the same time: the per-job default MASTER_PORT matters
    return {
        # --requeue: on SIGUSR1 checkpoint and requeue the job; the rerun (SLURM_RESTART_COUNT
        # > 0) resumes from the newest checkpoint
        "preempt": cluster.submit("submit_pm.sh", ["--config=tiny",
                                                   f"--num_iters={PREEMPT_ITERS}", "--requeue"],
                                  env=env("preempt"), cwd=str(REPO),
                                  sbatch_opts=["--open-mode=append", _out_opt(workdir)]),
        "single": cluster.submit("submit_pm.sh", ["--yaml_config=config/ViT.yaml",
                                                  "--config=tiny"],
                                 env=env("single"), sbatch_opts=[_out_opt(workdir)],
                                 cwd=str(REPO)),
        "dp": cluster.submit("submit_pm_dp.sh", ["--config=tiny"], env=env("dp"),
                             sbatch_opts=two_tasks, cwd=str(REPO)),
        "mp": cluster.submit("submit_pm_mp.sh", ["--config=tiny", "--row_parallel_size=2"],
                             env=env("mp"), sbatch_opts=two_tasks, cwd=str(REPO)),
    }


@pytest.mark.e2e
@pytest.mark.slurm
def test_preemption_requeue_resume(cluster, training_jobs):
    """The tutorial's preemption path under real SLURM: USR1 to the tasks -> train.py saves
    a checkpoint and requeues its own job -> the rerun (same arguments) resumes there.
    First of the job tests: the signal has to arrive while the job is still training."""
    job = training_jobs["preempt"]
    try:  # logged after the second training step: the stop signal handler is in place
        cluster.wait_output(job, "Memory of step 2", timeout=JOB_TIMEOUT)
    except TimeoutError as e:
        pytest.fail(str(e))
    cluster.signal(job, "USR1")  # what --signal=USR1@<seconds> sends before the time limit
    out = slurm_job_output(cluster, job, JOB_TIMEOUT)
    stopped = re.search(r"stopped at iteration (\d+)", out)
    resumed = re.search(r"Resumed from \S+: iteration (\d+)", out)
    assert stopped and resumed, out[-4000:]
    assert stopped.group(1) == resumed.group(1)
    assert "SLURM restart 1 " in out  # the rerun saw SLURM_RESTART_COUNT=1
    assert out.count("site=generic") == 2  # two runs of the batch script, one output file
    assert f"Finished {PREEMPT_ITERS} iterations" in out


@pytest.mark.e2e
@pytest.mark.slurm
def test_single_process_job(cluster, training_jobs):
    out = slurm_job_output(cluster, training_jobs["single"], JOB_TIMEOUT)
    assert "site=generic" in out
    assert re.search(r"task RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 ", out), out[-3000:]
    assert "world size 1 (env launcher)" in out, out[-3000:]
    assert len(re.findall(r"Time taken for epoch \d+ is [\d.]+ sec", out)) >= 1, out[-3000:]
    assert "Avg train loss=" in out


@pytest.mark.e2e
@pytest.mark.slurm
def test_data_parallel_job(cluster, training_jobs):
    out = slurm_job_output(cluster, training_jobs["dp"], JOB_TIMEOUT)
    tasks = re.findall(r"task RANK=(\d) LOCAL_RANK=(\d) WORLD_SIZE=2 MASTER_ADDR=(\S+) "
                       r"MASTER_PORT=(\d+)", out)
    assert sorted(t[:2] for t in tasks) == [("0", "0"), ("1", "1")], out[-3000:]
    assert len({t[2:] for t in tasks}) == 1, f"ranks disagree on the rendezvous: {tasks}"
    assert "world size 2 (env launcher)" in out, out[-3000:]
    assert "local batch 2" in out  # global batch 4 split over 2 data-parallel ranks
    assert re.search(r"Time taken for epoch \d+ is [\d.]+ sec", out), out[-3000:]


@pytest.mark.e2e
@pytest.mark.slurm
def test_model_parallel_job(cluster, training_jobs):
    """submit_pm_mp.sh runs train_mp.py: 2 tasks = tensor parallel 2 x data parallel 1."""
    out = slurm_job_output(cluster, training_jobs["mp"], JOB_TIMEOUT)
    assert "train_mp.py --config=tiny --row_parallel_size=2" in out
    assert "world size 2 (env launcher)" in out, out[-3000:]
    assert "local batch 4" in out  # dp = 1: each rank sees the whole global batch
    assert re.search(r"Time taken for epoch \d+ is [\d.]+ sec", out), out[-3000:]


@pytest.mark.e2e
@pytest.mark.slurm
def test_export_ddp_vars_with_scontrol(cluster):
    """The `scontrol show hostnames` path (a configured SLURM client on PATH)."""
    env = dict(cluster.env, SLURM_PROCID="0", SLURM_NTASKS="4",
               SLURM_JOB_NODELIST="gpu[010-013],cpu1")
    env.pop("MASTER_PORT", None)
    env.pop("DDP_MASTER_ADDR", None)
    assert _vars(_bash(DDP_PRINT, env).stdout)["MASTER_ADDR"] == "gpu010"


@pytest.mark.e2e
@pytest.mark.slurm
def test_preset_options_reach_sbatch(cluster):
    """A preset's SBATCH_* variables are real sbatch inputs: the Perlmutter preset's GPU
    options are rejected by this GPU-less cluster, the generic preset's job is accepted."""
    test_only = ["--test-only", "-N", "1", "submit_pm_dp.sh"]
    r = cluster.run([BASH, "-c", "source site/perlmutter.sh && sbatch " + " ".join(test_only)],
                    check=False, cwd=str(REPO), env={"SITE": None})
    assert r.returncode != 0 and re.search(r"Invalid (feature|generic resource)", r.stderr), \
        r.stderr
    for var, value, error in (("SBATCH_CONSTRAINT", "gpu", "Invalid feature"),
                              ("SBATCH_GPUS_PER_NODE", "4", "Invalid generic resource")):
        r = cluster.run(["sbatch", *test_only], check=False, cwd=str(REPO), env={var: value})
        assert r.returncode != 0 and error in r.stderr, f"{var}: {r.stderr}"
    r = cluster.run([str(REPO / "sbatch_site.sh"), *test_only], check=False, cwd=str(REPO),
                    env={"SITE": "generic"})
    assert r.returncode == 0 and "to start at" in r.stderr, r.stderr


PROBE = """\
import json, os, sys
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_NODEID",
        "TORCH_PROFILER_OUTPUT", "PROFILE_WITH_NSYS")
print("PROBE " + json.dumps({"argv": sys.argv[1:], **{k: os.environ.get(k) for k in keys}}))
"""


@pytest.mark.e2e
@pytest.mark.slurm
def test_two_node_model_parallel_layout(workdir):
    """submit_pm_mp.sh on two nodes x 2 tasks with TRAIN_SCRIPT = a probe: ranks, local ranks,
    one rendezvous, arguments passed through verbatim, the profiling fallback."""
    probe = workdir / "probe.py"
    probe.write_text(PROBE)
    c = start_slurm_cluster(nodes=2)
    try:
        env = _job_env(c, workdir, TRAIN_SCRIPT=str(probe), ENABLE_PROFILING="1",
                       PROFILE_OUTPUT="probe")
        args = ["--config=mp", "--row_parallel_size=2", "two words", "quote'\"$HOME"]
        job = c.submit("submit_pm_mp.sh", args, env=env, cwd=str(REPO),
                       sbatch_opts=["-N", "2", "--ntasks-per-node=2", _out_opt(workdir)])
        out = slurm_job_output(c, job, timeout=60)
        node1 = parse_fields(c.run(["scontrol", "show", "node", "node1", "-o"]).stdout)
    finally:
        c.stop()
    try:
        seen = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
                if line.startswith("PROBE ")]
    except ValueError as e:
        pytest.fail(f"unreadable probe line ({e}) in:\n{out}")
    assert len(seen) == 4, out
    by_rank = {int(s["RANK"]): s for s in seen}
    assert sorted(by_rank) == [0, 1, 2, 3]
    for rank, s in by_rank.items():
        assert s["argv"] == args
        assert s["WORLD_SIZE"] == "4"
        assert (int(s["SLURM_NODEID"]), int(s["LOCAL_RANK"])) == divmod(rank, 2)
        assert s["TORCH_PROFILER_OUTPUT"] is None or shutil.which("nsys")  # trace: run dir
    assert len({(s["MASTER_ADDR"], s["MASTER_PORT"]) for s in seen}) == 1
    # node1 is a SLURM name, not a host name: the first node's address (NodeAddr) instead
    assert by_rank[0]["MASTER_ADDR"] == node1["NodeAddr"] != "node1"


@pytest.mark.e2e
@pytest.mark.slurm
def test_the_gpu_self_tests_two_node_srun_starts_a_task_on_each_node(workdir):
    """The GPU self-test's two-node test runs inside `srun -n 1 make test-gpu`, a step of
    one task: its srun (helpers.srun_on_two_nodes) still starts one task on each of the
    job's two nodes."""
    probe = ["bash", "-c", 'echo "TASK $SLURM_PROCID of $SLURM_NTASKS on node $SLURM_NODEID"']
    inner = shlex.join(srun_on_two_nodes("srun", probe))
    script = workdir / "two_node_step.sh"
    script.write_text(f"#!/bin/bash\nsrun -n 1 bash -c {shlex.quote(inner)}\n")
    c = start_slurm_cluster(nodes=2)
    try:
        job = c.submit(str(script), env=_job_env(c, workdir), cwd=str(REPO),
                       sbatch_opts=["-N", "2", _out_opt(workdir)])
        out = slurm_job_output(c, job, timeout=60)
    finally:
        c.stop()
    tasks = sorted(line for line in out.splitlines() if line.startswith("TASK "))
    assert tasks == ["TASK 0 of 2 on node 0", "TASK 1 of 2 on node 1"], out


SIGNAL_JOB = """\
#!/bin/bash
echo "start restart=${SLURM_RESTART_COUNT:-0}"
if [ "${SLURM_RESTART_COUNT:-0}" -ge 1 ]; then echo "second run"; exit 0; fi
trap 'echo "got USR1"' USR1
for i in $(seq 1200); do sleep 0.1; done
exit 3
"""


@pytest.mark.e2e
@pytest.mark.slurm
def test_harness_signal_and_requeue(cluster, workdir):
    """cluster.signal reaches the batch shell; cluster.requeue reruns the job
    (SLURM_RESTART_COUNT=1), the output of both runs kept with --open-mode=append."""
    script = workdir / "signal_job.sh"
    script.write_text(SIGNAL_JOB)
    job = cluster.submit(str(script), cwd=str(workdir),
                         sbatch_opts=["--open-mode=append", _out_opt(workdir)])
    cluster.wait_output(job, "start restart=0", timeout=30)
    cluster.signal(job, "USR1", batch=True)
    cluster.wait_output(job, "got USR1", timeout=30)
    cluster.requeue(job)
    out = slurm_job_output(cluster, job, timeout=90)
    assert "start restart=1" in out and "second run" in out, out
