"""distributed/startup_checks.py: a too-old PyTorch and GPUs that were assigned but are not visible
stop the process with one line, on CPU: the environment, the version string and the CUDA
device count are injected; the CLI runs against this machine's real (CPU) PyTorch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import REPO, child_env, one_line

from distributed.startup_checks import (
    MIN_TORCH,
    check_gpus_visible,
    check_torch_version,
    gpu_request,
    parse_version,
    torch_version_problem,
)
from utils.errors import LaunchError

MIN = ".".join(map(str, MIN_TORCH))


# ----------------------------------------------------------------- torch version

@pytest.mark.parametrize("text, want", [
    ("2.13.0", (2, 13, 0)), ("2.13.0+cpu", (2, 13, 0)), ("2.1.0a0+b5021ba", (2, 1, 0)),
    ("2.10.0a0+b4e4ee81d3", (2, 10, 0)), ("2.7", (2, 7, 0)), ("2.7.1+cu126", (2, 7, 1)),
])
def test_versions_parse_to_their_numeric_release(text, want):
    assert parse_version(text) == want


@pytest.mark.parametrize("version", ["2.1.0a0+b5021ba", "2.2.0", "2.6.0+cu124", "2.7.0",
                                     "1.13.1"])
def test_a_torch_older_than_the_minimum_is_a_one_line_error_naming_the_minimum(version):
    with pytest.raises(LaunchError) as e:
        check_torch_version(version)
    msg = one_line(e)
    assert f"PyTorch {version} is too old" in msg and f">= {MIN}" in msg
    assert "site/README.md" in msg


@pytest.mark.parametrize("version", [MIN, "2.10.0a0+b4e4ee81d3", "2.13.0+cpu", "3.0.0"])
def test_the_minimum_and_newer_pass(version):
    assert torch_version_problem(version) is None
    check_torch_version(version)


def test_this_machines_torch_passes():
    check_torch_version()  # the test environment's torch (2.13)
    assert parse_version(torch.__version__) >= MIN_TORCH


# ----------------------------------------------------------------- GPUs requested?

@pytest.mark.parametrize("env, want", [
    ({}, None),
    ({"SLURM_JOB_ID": "12", "SLURM_PROCID": "0"}, None),           # a CPU job
    ({"SLURM_STEP_GPUS": "2"}, "SLURM_STEP_GPUS=2"),
    ({"SLURM_JOB_GPUS": "0,1,2,3"}, "SLURM_JOB_GPUS=0,1,2,3"),
    ({"SLURM_JOB_GPUS": "0"}, "SLURM_JOB_GPUS=0"),                 # GPU number 0
    ({"SLURM_GPUS_ON_NODE": "4"}, "SLURM_GPUS_ON_NODE=4"),
    ({"SLURM_GPUS_ON_NODE": "0"}, None),                           # a count of zero
    ({"SLURM_GPUS_PER_NODE": "a100:4"}, "SLURM_GPUS_PER_NODE=a100:4"),
    ({"SLURM_GPUS_PER_NODE": "a100:0"}, None),
    ({"SLURM_GPUS_PER_TASK": "1"}, "SLURM_GPUS_PER_TASK=1"),
    ({"SLURM_GPUS": "8"}, "SLURM_GPUS=8"),
    ({"SLURM_TRES_PER_TASK": "cpu=8,gres/gpu=1"}, "SLURM_TRES_PER_TASK=cpu=8,gres/gpu=1"),
    ({"SLURM_TRES_PER_TASK": "cpu=8"}, None),
    ({"CUDA_VISIBLE_DEVICES": "3,2,1,0"}, "CUDA_VISIBLE_DEVICES=3,2,1,0"),
    ({"CUDA_VISIBLE_DEVICES": ""}, None),                          # hidden on purpose
    ({"CUDA_VISIBLE_DEVICES": "-1"}, None),
    ({"CUDA_VISIBLE_DEVICES": "-1", "SLURM_JOB_GPUS": "0"}, None),  # ... even in a GPU job
    ({"SBATCH_GPUS_PER_NODE": "4"}, None),  # a preset sourced in a login shell: no job yet
])
def test_which_environments_request_gpus(env, want):
    assert gpu_request(env) == want


# ----------------------------------------------------------------- fail fast

def assert_refuses(env, count=0, cpu_only=False) -> str:
    with pytest.raises(LaunchError) as e:
        check_gpus_visible(env, device_count=lambda: count, cpu_only_build=cpu_only)
    msg = one_line(e)
    assert "PyTorch sees no CUDA device" in msg and "refusing to train on the CPU" in msg
    return msg


def test_gpus_assigned_by_slurm_but_none_visible_is_an_error_naming_the_variable():
    msg = assert_refuses({"SLURM_STEP_GPUS": "0,1,2,3", "SLURM_PROCID": "1"})
    assert "(SLURM_STEP_GPUS=0,1,2,3)" in msg and "driver" in msg


def test_a_gpu_order_naming_devices_the_task_cannot_see_is_the_reason_given():
    """site/common.sh's old bug: CUDA_VISIBLE_DEVICES=3,2,1,0 for a task bound to GPU 2."""
    msg = assert_refuses({"SLURM_STEP_GPUS": "2", "CUDA_VISIBLE_DEVICES": "3,2,1,0"})
    assert "CUDA_VISIBLE_DEVICES=3,2,1,0 names no GPU this task can use" in msg


def test_a_cpu_only_torch_in_a_gpu_job_is_the_reason_given():
    msg = assert_refuses({"SLURM_GPUS_ON_NODE": "4"}, cpu_only=True)
    assert "CPU-only build" in msg and torch.__version__ in msg


def test_a_device_count_passed_as_a_number_works_too():
    with pytest.raises(LaunchError):
        check_gpus_visible({"SLURM_JOB_GPUS": "1"}, device_count=0, cpu_only_build=False)
    check_gpus_visible({"SLURM_JOB_GPUS": "1"}, device_count=1, cpu_only_build=False)


@pytest.mark.parametrize("env", [
    {}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, {"CUDA_VISIBLE_DEVICES": ""},
    {"CUDA_VISIBLE_DEVICES": "-1", "SLURM_GPUS_ON_NODE": "4"},
])
def test_a_cpu_run_nobody_asked_gpus_for_passes(env):
    check_gpus_visible(env, device_count=lambda: 0, cpu_only_build=True)


def test_visible_gpus_pass():
    check_gpus_visible({"SLURM_STEP_GPUS": "2", "CUDA_VISIBLE_DEVICES": "0"},
                       device_count=lambda: 1, cpu_only_build=False)


def test_the_device_count_is_not_asked_for_when_no_gpu_was_requested():
    def never() -> int:
        raise AssertionError("device_count called for a CPU run")

    check_gpus_visible({"SLURM_PROCID": "0"}, device_count=never)


# ----------------------------------------------------------------- the CLI, this machine

def run_cli(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distributed.startup_checks"], cwd=REPO,
                          env=child_env(env), capture_output=True, text=True, timeout=120)


@pytest.mark.e2e
def test_cli_in_a_slurm_gpu_step_on_this_cpu_machine_exits_2_with_one_line():
    r = run_cli(SLURM_STEP_GPUS="0", SLURM_PROCID="0")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: GPUs were requested"), r.stderr
    if torch.version.cuda is None:
        assert "CPU-only build" in lines[0]


@pytest.mark.e2e
def test_cli_without_a_gpu_request_says_ok():
    r = run_cli()
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"ok: PyTorch {torch.__version__}")
    assert "no GPU requested" in r.stdout
