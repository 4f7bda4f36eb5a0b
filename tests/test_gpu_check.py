"""`make gpu-check`'s pieces that need no GPU and start nothing (unit tier): the preflight's
one-line refusals, the report (a check that fails, raises, runs out of GPU memory or cannot
run is a line and the others still run; markdown and JSON), the wheel folder's logic (what
`make wheels` downloads, what an interpreter lacks, a folder that does not fit), the GPU
peaks the ladder's MFU divides by, and the plan's 8 minutes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import REPO

from tools.gpu_check import preflight, wheels
from tools.gpu_check.report import Line, Outcome, Skip, markdown, run_line, write

# ----------------------------------------------------------------------------- preflight


def test_no_torch_old_torch_and_no_gpu_are_one_line_each():
    no_torch = preflight.problem(None, environ={})
    assert "has no PyTorch" in no_torch and "PY=<python>" in no_torch
    old = preflight.problem(preflight.Torch("2.6.0+cu124", "12.4", 1), environ={})
    assert "2.6.0+cu124 is too old" in old and ">= 2.7.1" in old
    cpu = preflight.problem(preflight.Torch("2.13.0+cpu", None, 0), environ={})
    assert cpu.startswith("no GPU: PyTorch 2.13.0+cpu (a CPU-only build) sees no CUDA device")
    cuda = preflight.problem(preflight.Torch("2.13.0", "13.0", 0), environ={})
    assert "(CUDA 13.0) sees no CUDA device" in cuda
    slurm = preflight.problem(preflight.Torch("2.13.0", "12.8", 0),
                              environ={"SLURM_JOB_GPUS": "0,1"})
    assert "GPUs were requested for this task (SLURM_JOB_GPUS=0,1)" in slurm
    for line in (no_torch, old, cpu, cuda, slurm):
        assert "\n" not in line
    assert preflight.problem(preflight.Torch("2.7.1+cu126", "12.6", 1), environ={}) is None
    assert preflight.problem(preflight.Torch("2.13.0", "13.0", 4), environ={}) is None


def test_a_pytorch_newer_than_the_tested_one_is_a_warning_not_a_refusal():
    assert "newer than the tested 2.13" in preflight.newer_than_tested("2.14.0a0+git1234")
    assert preflight.newer_than_tested("2.13.1") is None
    assert preflight.newer_than_tested("2.7.1") is None
    assert preflight.problem(preflight.Torch("2.14.0", "13.0", 1), environ={}) is None


# ----------------------------------------------------------------------------- report

def test_a_failing_raising_oom_or_skipped_check_is_a_line_and_the_next_still_runs(tmp_path):
    log = tmp_path / "gpu-check.log"

    def oom() -> Outcome:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def bug() -> Outcome:
        raise ValueError("something broke\nsecond line")

    def skip() -> Outcome:
        raise Skip("TF32 needs a GPU")

    plan = [("ok", lambda: Outcome(True, "1e-7 apart")),
            ("fails", lambda: Outcome(False, "1e-2 apart", "more than 1e-4 apart")),
            ("oom", oom), ("bug", bug), ("skip", skip),
            ("after", lambda: Outcome(True, "still ran"))]
    lines = [run_line("checks", name, fn, 5, log) for name, fn in plan]
    assert [line.status for line in lines] == ["ok", "FAIL", "skip", "FAIL", "skip", "ok"]
    assert lines[2].detail.startswith("the GPU is too small for this check (RuntimeError: "
                                      "CUDA out of memory")
    assert lines[3].detail == "ValueError: something broke"  # one line; traceback in the log
    assert "second line" in log.read_text() and "--- checks: bug" in log.read_text()
    assert lines[4].detail == "TF32 needs a GPU"
    assert all(line.estimate_s == 5 for line in lines)


def test_the_report_is_markdown_to_paste_and_the_same_lines_as_json(tmp_path):
    lines = [Line("environment", "versions", "info", "torch 2.13.0"),
             Line("checks", "compile = eager", "FAIL", "1e-2 apart", "more than 1e-4 apart",
                  41.0, 40.0, {"loss_rel_err": 0.01}),
             Line("checks", "TF32", "skip", detail="TF32 needs a GPU", estimate_s=5),
             Line("ladder", "+ bf16", "info", "40.1 samples/s", "A100-40GB (tutorial): 42.6",
                  12.0, 15.0)]
    sections = {"environment": "Environment", "checks": "Checks", "memory": "Memory",
                "ladder": "The ladder"}
    md_path, js_path = write(tmp_path, "gpu-check report", ["H200 on node1"], lines, sections,
                             {"memory": ["Not measured here: it needs a GPU."]}, {"gpu": "H200"})
    md = md_path.read_text()
    assert md == markdown("gpu-check report", ["H200 on node1"], lines, sections,
                          {"memory": ["Not measured here: it needs a GPU."]})
    assert "Result: **1 failed**: compile = eager; 1 skipped" in md
    assert "| compile = eager | **FAIL** | 1e-2 apart | 41 s (40 s) | more than 1e-4 apart |" \
        in md
    assert "## Memory\n\nNot measured here" in md  # a section with only its extra text
    data = json.loads(js_path.read_text())
    assert data["facts"] == {"gpu": "H200"}
    assert [Line(**line) for line in data["lines"]] == lines


# ----------------------------------------------------------------------------- wheels

def test_make_wheels_collects_every_requirement_but_the_sites_torch_and_dali():
    reqs = wheels.project_requirements(REPO / "requirements.txt")
    names = {wheels.requirement_name(r) for r in reqs}
    assert "torch" not in names and not any(n.startswith("nvidia-dali") for n in names)
    assert {"numpy", "h5py", "ruamel-yaml", "pydantic", "tensorboard", "xarray"} <= names
    dev = wheels.project_requirements(REPO / "requirements-dev.txt")  # follows -r
    assert set(reqs) < set(dev) and "torch" not in {wheels.requirement_name(r) for r in dev}
    extra = wheels.project_requirements(REPO / "requirements.txt", ["nvidia-dali-cuda120"])
    assert extra[-1] == "nvidia-dali-cuda120"


def test_the_download_asks_pip_for_binary_wheels_of_that_python_on_manylinux():
    command = wheels.download_command(Path("w"), "3.12", "2.28", ["numpy>=1.24"],
                                      pip=["pip"])
    assert command[:6] == ["pip", "download", "--only-binary=:all:", "--dest", "w",
                           "--python-version"]
    assert command[6:9] == ["3.12", "--implementation", "cp"]
    tags = [command[i + 1] for i, word in enumerate(command) if word == "--platform"]
    assert tags[0] == "manylinux_2_28_x86_64" and tags[-2:] == ["manylinux_2_17_x86_64",
                                                                "manylinux2014_x86_64"]
    assert command[-2:] == ["pip", "numpy>=1.24"]  # pip's own wheel, for a node without pip
    with pytest.raises(wheels.WheelsError, match="--python 312: expected"):
        wheels.download_command(Path("w"), "312", "2.28", [])
    with pytest.raises(wheels.WheelsError, match="--glibc 2.12"):
        wheels.platforms("2.12")


def test_only_what_the_interpreter_lacks_or_has_too_old_is_installed():
    assert wheels.unmet(["pytest>=1", "surely-not-a-package-here>=1", "pytest>=999"]) == \
        ["surely-not-a-package-here>=1", "pytest>=999"]


def test_a_folder_that_is_missing_for_another_python_or_without_a_wheel_is_one_line(tmp_path):
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    with pytest.raises(wheels.WheelsError, match="no such folder"):
        wheels.check_folder(tmp_path / "absent", ["numpy"])
    (tmp_path / wheels.MANIFEST).write_text(json.dumps({"python": "3.99"}))
    with pytest.raises(wheels.WheelsError, match=f"Python 3.99, but .* is Python {here}; "
                       f"make wheels WHEELS=.* WHEELS_PYTHON={here}"):
        wheels.check_folder(tmp_path, ["numpy"])
    (tmp_path / wheels.MANIFEST).write_text(json.dumps({"python": here}))
    (tmp_path / "ruamel.yaml-0.18.6-py3-none-any.whl").touch()
    wheels.check_folder(tmp_path, ["ruamel.yaml>=0.17"])  # names compared canonically
    with pytest.raises(wheels.WheelsError, match="has no wheel of h5py, "):
        wheels.check_folder(tmp_path, ["ruamel.yaml", "h5py>=3.8"])
    with pytest.raises(wheels.WheelsError, match="lacks surely-absent: make wheels"):
        wheels.install(tmp_path / "env", None, ["surely-absent"])


# ----------------------------------------------------------------------------- plan, MFU

def test_the_ladder_divides_by_the_named_gpus_dense_peak():
    import torch

    from tools.gpu_check.ladder import peak_tflops

    assert peak_tflops("NVIDIA H100 PCIe", torch.bfloat16) == 756
    assert peak_tflops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989
    assert peak_tflops("NVIDIA H200", torch.float16) == 989
    assert peak_tflops("NVIDIA A100-SXM4-40GB", torch.bfloat16) == 312
    assert peak_tflops("Tesla V100-SXM2-16GB", torch.bfloat16) is None


def test_the_plan_fits_eight_minutes_with_the_install_before_it():
    from tools.gpu_check.__main__ import BUDGET_S, PLAN

    assert sum(seconds for seconds, _ in PLAN.values()) <= BUDGET_S <= 8 * 60 - 60
