"""site/task.sh: what each SLURM task runs, checked on CPU by calling its bash functions
with the variables SLURM and the site preset set, and through site/common.sh's real task
script with stand-in `nsys` / `nvidia-smi` executables that only report how they were called
(neither can run here).

  - the site's GPU order (Perlmutter: 3,2,1,0) is applied only when the task sees all of the
    node's GPUs; a task bound to one GPU keeps SLURM's CUDA_VISIBLE_DEVICES;
  - the nsys command line: -f true (a rerun overwrites its report), the capture range, and
    --cuda-graph-trace=node for the CUDA-graph script; without nsys the torch.profiler path.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

BASH = shutil.which("bash") or "/bin/bash"
BASE_PATH = "/usr/local/bin:/usr/bin:/bin"
NSYS_BASE = ["nsys", "profile", "-f", "true"]
NSYS_RANGE = ["--trace=cuda,nvtx,osrt", "-c", "cudaProfilerApi", "--capture-range-end=stop"]


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def tool_dir(tmp_path: Path, nsys: bool = False, gpus: int | None = None) -> Path:
    """A directory for PATH with a stand-in nsys (prints its argv and environment as JSON)
    and/or nvidia-smi -L (lists `gpus` GPUs)."""
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    if nsys:
        executable(tools / "nsys", f"#!{sys.executable}\n"
                   "import json, os, sys\n"
                   "print('NSYS ' + json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}))\n")
    if gpus is not None:
        lines = "".join(f"echo 'GPU {i}: NVIDIA A100-SXM4-40GB (UUID: GPU-{i})'\n"
                        for i in range(gpus))
        executable(tools / "nvidia-smi", f"#!{BASH}\n{lines}")
    return tools


def bash(script: str, env: dict[str, str], tools: Path | None = None) -> str:
    full = {"PATH": f"{tools}:{BASE_PATH}" if tools else BASE_PATH, **env}
    r = subprocess.run([BASH, "-c", f"source site/task.sh\n{script}"], cwd=REPO, env=full,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def gpu_order(env: dict[str, str], tools: Path | None = None) -> str:
    return bash("task_gpu_order", env, tools).strip()


def command(env: dict[str, str], *argv: str, tools: Path | None = None
            ) -> tuple[list[str], dict[str, str]]:
    """TASK_CMD as a list, and the profiling variables task_command exported."""
    script = (f"task_command {shlex.join(argv)}\nprintf '%s\\0' \"${{TASK_CMD[@]}}\"\n"
              "echo; env | grep -E '^(PROFILE_WITH_NSYS|TORCH_PROFILER_OUTPUT)=' || true")
    out = bash(script, {"PYTHON": "python3", "LOG_DIR": "/logs", **env}, tools)
    cmd, _, rest = out.partition("\n")
    exported = dict(line.split("=", 1) for line in rest.splitlines() if "=" in line)
    return cmd.rstrip("\0").split("\0"), exported


# ----------------------------------------------------------------- GPU order

PM = {"SITE_CUDA_VISIBLE_DEVICES": "3,2,1,0"}


@pytest.mark.parametrize("visible", ["0,1,2,3", "3,2,1,0", "1,0,3,2", "0, 1, 2, 3"])
def test_the_site_order_is_applied_when_the_task_sees_all_of_the_nodes_gpus(visible):
    assert gpu_order({**PM, "CUDA_VISIBLE_DEVICES": visible}) == "3,2,1,0"


@pytest.mark.parametrize("visible", ["2", "0", "0,1", "1,2,3", "GPU-8a1b,GPU-77c2"])
def test_a_task_bound_to_some_gpus_keeps_slurms_list(visible):
    """srun --gpus-per-task=1 gives each task one GPU; 3,2,1,0 would hide it from CUDA."""
    assert gpu_order({**PM, "CUDA_VISIBLE_DEVICES": visible}) == ""


def test_gpus_hidden_on_purpose_stay_hidden():
    assert gpu_order({**PM, "CUDA_VISIBLE_DEVICES": ""}) == ""


def test_no_site_order_keeps_everything():
    assert gpu_order({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == ""


@pytest.mark.parametrize("gpus, want", [(4, "3,2,1,0"), (2, ""), (8, ""), (0, "")])
def test_without_cuda_visible_devices_the_order_needs_exactly_those_gpus(tmp_path, gpus, want):
    assert gpu_order(PM, tool_dir(tmp_path, gpus=gpus)) == want


def test_without_cuda_visible_devices_or_nvidia_smi_nothing_is_reordered():
    assert gpu_order(PM) == ""


# ----------------------------------------------------------------- the command line

def test_profiling_under_nsys_overwrites_and_opens_the_capture_range(tmp_path):
    cmd, exported = command({"ENABLE_PROFILING": "1", "PROFILE_OUTPUT": "baseline",
                             "WORLD_SIZE": "1", "RANK": "0"},
                            "train.py", "--config=short", "two words",
                            tools=tool_dir(tmp_path, nsys=True))
    assert cmd == [*NSYS_BASE, "-o", "/logs/baseline", *NSYS_RANGE,
                   "python3", "train.py", "--config=short", "two words"]
    assert exported == {"PROFILE_WITH_NSYS": "1"}


@pytest.mark.parametrize("script, graphs_env", [
    ("train_mp_graphs.py", "0"), ("/abs/path/train_mp_graphs.py", "0"), ("mine.py", "1"),
])
def test_the_cuda_graph_script_is_traced_node_by_node(tmp_path, script, graphs_env):
    cmd, _ = command({"ENABLE_PROFILING": "1", "ENABLE_CUDA_GRAPHS": graphs_env,
                      "WORLD_SIZE": "4", "RANK": "2"}, script, "--tp=4",
                     tools=tool_dir(tmp_path, nsys=True))
    assert cmd == [*NSYS_BASE, "-o", "/logs/profile_rank2", *NSYS_RANGE,
                   "--cuda-graph-trace=node", "python3", script, "--tp=4"]


def test_other_scripts_are_not_traced_node_by_node(tmp_path):
    cmd, _ = command({"ENABLE_PROFILING": "1", "WORLD_SIZE": "2", "RANK": "1"},
                     "train_mp.py", tools=tool_dir(tmp_path, nsys=True))
    assert "--cuda-graph-trace=node" not in cmd and cmd[:6] == [*NSYS_BASE, "-o",
                                                               "/logs/profile_rank1"]


def test_without_nsys_the_training_script_writes_its_trace_into_its_run_directory():
    # Nothing exported: training/profiling.py then writes <run dir>/profile/, as it does
    # outside SLURM, so the README names one place for both.
    cmd, exported = command({"ENABLE_PROFILING": "1"}, "train.py", "--config=short")
    assert cmd == ["python3", "train.py", "--config=short"]
    assert exported == {}


@pytest.mark.parametrize("flag", ["", "0", "false"])
def test_without_profiling_the_script_runs_bare(tmp_path, flag):
    cmd, exported = command({"ENABLE_PROFILING": flag}, "train.py",
                            tools=tool_dir(tmp_path, nsys=True))
    assert cmd == ["python3", "train.py"] and exported == {}


# ----------------------------------------------------------------- through site/common.sh

PROBE = """\
import json, os, sys
print("PROBE " + json.dumps({"argv": sys.argv[1:], "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
                             "prof": os.environ.get("TORCH_PROFILER_OUTPUT")}))
"""


def run_common_task(tmp_path: Path, tools: Path | None, *argv: str, **env: str) -> str:
    """The task script site/common.sh hands to srun, run here as one SLURM task would."""
    base = {"PATH": f"{tools}:{BASE_PATH}" if tools else BASE_PATH, "HOME": str(tmp_path),
            "SITE": "generic", "PYTHON": sys.executable, "LOG_DIR": str(tmp_path / "logs"),
            "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_ID": "77"}
    script = f'source site/common.sh && bash -c "$_TASK" task {shlex.join(argv)}'
    r = subprocess.run([BASH, "-c", script], cwd=REPO, env={**base, **env},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def tagged(out: str, tag: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith(tag + " ")]
    assert len(lines) == 1, out
    return json.loads(lines[0].split(" ", 1)[1])


def test_common_sh_task_runs_nsys_with_the_graph_trace_and_the_ddp_variables(tmp_path):
    out = run_common_task(tmp_path, tool_dir(tmp_path, nsys=True), "train_mp_graphs.py",
                          "--tp=2", ENABLE_PROFILING="1", PROFILE_OUTPUT="graphs",
                          SITE_CUDA_VISIBLE_DEVICES="1,0", CUDA_VISIBLE_DEVICES="0,1")
    assert "task RANK=1 LOCAL_RANK=1 WORLD_SIZE=2 MASTER_ADDR=node1" in out
    seen = tagged(out, "NSYS")
    assert seen["argv"] == ["profile", "-f", "true", "-o", str(tmp_path / "logs/graphs_rank1"),
                            *NSYS_RANGE, "--cuda-graph-trace=node", sys.executable,
                            "train_mp_graphs.py", "--tp=2"]
    env = seen["env"]
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "2", str(29500 + 77))
    assert env["PROFILE_WITH_NSYS"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "1,0"


def test_common_sh_task_bound_to_one_gpu_keeps_it_and_runs_python(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = run_common_task(tmp_path, None, str(probe), "a b", "--x=1", ENABLE_PROFILING="1",
                          SITE_CUDA_VISIBLE_DEVICES="3,2,1,0", CUDA_VISIBLE_DEVICES="2")
    assert "CUDA_VISIBLE_DEVICES=2" in out  # the task line says what the task got
    seen = tagged(out, "PROBE")
    assert seen == {"argv": ["a b", "--x=1"], "cvd": "2", "prof": None}


def test_task_sh_is_not_offered_as_a_site_preset():
    r = subprocess.run([BASH, "-c", "source site/load.sh"], cwd=REPO, capture_output=True,
                       text=True, env={"PATH": os.environ.get("PATH", BASE_PATH),
                                       "SITE": "nowhere"}, timeout=30)
    assert r.returncode != 0 and "presets:" in r.stderr
    assert " task " not in f" {r.stderr.split('presets:')[1]} "


# ----------------------------------------------------------------- the Perlmutter preset

def preset(env: dict[str, str]) -> dict[str, str]:
    r = subprocess.run([BASH, "-c", "source site/perlmutter.sh && env"], cwd=REPO,
                       env={"PATH": BASE_PATH, "HOME": "/nonexistent", **env},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)


def test_perlmutter_runs_an_image_whose_pytorch_is_new_enough():
    """The image named in the preset is one whose release notes give PyTorch >= MIN_TORCH
    (NGC 25.12: 2.10.0a0); the old ngc-23.07 image (PyTorch 2.1) is gone."""
    from distributed.startup_checks import torch_version_problem

    pm = preset({"SCRATCH": "/scratch"})
    assert "--image=nvcr.io/nvidia/pytorch:25.12-py3" in pm["SITE_LAUNCHER"]
    assert "--module=gpu,nccl-plugin" in pm["SITE_SBATCH_ARGS"]
    assert "ngc-23.07" not in (REPO / "site" / "perlmutter.sh").read_text()
    assert torch_version_problem("2.10.0a0+b4e4ee81d3") is None


def test_perlmutter_uses_the_venv_on_top_of_the_image_when_it_exists(tmp_path):
    assert preset({"SCRATCH": str(tmp_path)})["PYTHON"] == "python"  # the image's python
    venv = tmp_path / "vit-era5" / "venv"
    venv.mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("include-system-site-packages = true\n")
    # bin/python links to the image's python, which need not exist outside the container
    assert preset({"SCRATCH": str(tmp_path)})["PYTHON"] == str(venv / "bin" / "python")
    assert preset({"SCRATCH": str(tmp_path), "PYTHON": "/x/python"})["PYTHON"] == "/x/python"
