"""`make gpu-check`'s pieces that need no GPU and start nothing (unit tier): the preflight's
one-line refusals, the devices the GPU branch hands to PyTorch (each names its GPU's index,
as `torch.cuda.set_device`'s argument check, run on a CPU too, requires), the report (a
check that fails, raises, runs out of GPU memory or cannot run is a line and the others
still run; out of memory at the planner's own batch is a FAIL with its figures; markdown
and JSON), the wheel folder's logic (what `make wheels` downloads and the pip it needs,
what an interpreter lacks, a folder that does not fit), the GPU peaks the ladder's MFU
divides by, and the plan's 8 minutes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO

from tools.gpu_check import preflight, wheels
from tools.gpu_check.report import Line, Outcome, Skip, markdown, run_line, write
from utils import devices

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


# ----------------------------------------------------------------------------- devices

def test_every_gpu_device_names_its_index_as_pytorchs_argument_checks_require():
    """torch.cuda.set_device (and Stream, the memory statistics) check the device with
    `_get_device_index` before any CUDA call: on a CPU the same check runs."""
    from torch.cuda._utils import _get_device_index

    from distributed.comm import process_device
    from tools.gpu_check.__main__ import parse_args

    made = [devices.gpu(2), devices.of_kind(parse_args([]).device),  # make gpu-check's
            *(process_device(rank, 4, environ={}) for rank in range(4)),  # training's
            process_device(3, 1, environ={})]  # a task bound to its own GPU
    assert all(d.type == "cuda" for d in made)
    assert [_get_device_index(d, optional=False) for d in made] == [2, 0, 0, 1, 2, 3, 0]
    assert [d.index for d in made] == [2, 0, 0, 1, 2, 3, 0]  # DDP's device_ids, DALI's id
    assert process_device(0, 0, environ={}) == devices.of_kind("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="Expected a torch.device with a specified index"):
        _get_device_index(torch.device("cuda"), optional=False)  # what a bare one meets
    for bad in (-1, True, "0", 1.0):
        with pytest.raises(ValueError, match=f"GPU index {bad!r}: expected an integer >= 0"):
            devices.gpu(bad)
    with pytest.raises(ValueError, match="device 'xpu': expected one of cuda, cpu"):
        devices.of_kind("xpu")


def test_join_with_a_bare_cuda_device_raises_what_make_gpu_check_died_of():
    import torch.distributed as dist

    from tools.gpu_check import harness

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"^Expected a torch.device with a specified index "
                       r"or an integer, but got:cuda$"):
        harness.join(torch.device("cuda"))
    assert not dist.is_initialized()


def test_no_device_is_made_outside_the_one_helper():
    """Every torch.device of the product, the tools and the benchmarks that is not the CPU
    or the meta device is made by utils/devices.py, and no call names "cuda" as a device."""
    import ast

    packages = [p for p in REPO.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"]
    found = []
    for path in sorted([*REPO.glob("*.py"), *(f for p in packages for f in p.rglob("*.py"))]):
        rel, text = path.relative_to(REPO), path.read_text()
        if "device" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call):
                continue
            func, first = node.func, node.args[0] if node.args else None
            made_here = (isinstance(func, ast.Attribute) and func.attr == "device"
                         and isinstance(func.value, ast.Name) and func.value.id == "torch"
                         and not (isinstance(first, ast.Constant) and first.value in
                                  ("cpu", "meta")))
            named_cuda = [k for k in node.keywords if k.arg in ("device", "device_id",
                          "device_ids") and isinstance(k.value, ast.Constant)
                          and str(k.value.value).startswith("cuda")]
            if (made_here and rel != Path("utils/devices.py")) or named_cuda:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


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


def test_out_of_memory_at_the_planners_batch_is_a_fail_with_the_planned_figures():
    """The memory section's batch is the planner's pick at 90 % of the GPU: out of memory
    there means the planner underestimated. (The error as PyTorch words it; on a CPU the
    allocator's peaks read 0 through the same calls.)"""
    from planning.memory import GIB, Estimate
    from tools.gpu_check import memory

    error = ("CUDA out of memory. Tried to allocate 318.00 MiB. GPU 0 has a total capacity "
             "of 39.39 GiB of which 171.06 MiB is free.")
    estimate = Estimate({"activations": 30.0 * GIB}, "backward", 30.0 * GIB, 20.0 * GIB)
    line = run_line("memory", "mp, tp 1", lambda: memory.out_of_memory(
        "mp", devices.gpu(0), 12, estimate, 39.39, error), 40)
    assert line.status == "FAIL", line
    assert line.number.startswith("batch 12 ran out of memory: planned allocated 30")
    assert "(within 90% of the GPU's 39.4); at the failure allocated " in line.number
    assert line.number.endswith(", tried to allocate 318.00 MiB")
    assert line.detail.startswith("the planner underestimated")
    assert line.data["out_of_memory"] and line.data["planned_tensors_gib"] == 30.0
    assert line.data["planned_in_use_gib"] > line.data["planned_reserved_gib"] > 30
    assert line.data["tried_to_allocate"] == "318.00 MiB"


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


def test_make_wheels_needs_a_pip_that_takes_several_platforms():
    assert wheels.pip_problem("pip 20.3 from /x (python 3.7)") is None
    assert wheels.pip_problem("pip 26.3 from /x (python 3.11)") is None
    old = wheels.pip_problem("pip 18.1 from /x (python 3.6)", python="py")
    assert old == ("pip 18.1 of py keeps one --platform only; make wheels gives several "
                   "(manylinux 2.17 to the nodes' glibc) and needs pip >= 20.3: py -m pip "
                   "install --upgrade pip, or give another PYTHON=<python>")
    assert wheels.pip_problem("", python="py").startswith("py has no pip (make wheels runs")
    assert wheels.pip_problem(f"pip {'.'.join(map(str, wheels.MIN_PIP))}") is None


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
