"""The gpu-check run on a CPU, as a user runs it (`python -m tools.gpu_check --device cpu`), for
the checks that mean something there (tools/gpu_check/checks.py says what each proves):

  - compile = eager, fp16 with a forced overflow (the step skipped, the scale halved), bf16 +
    fused Adam, recompute = plain, FSDP on a one-rank group, `--fsdp --enable_jit` = eager
    FSDP (one graph, no break) pass; the CUDA-graph replay and TF32 say they need a GPU;
  - memory: the planner's tensors within 15 % of the allocations the profiler measures
    (the tiny config);
  - rates: the operator rates measured (small shapes) into a machine file the dry run reads;
  - the ladder's first two rows time the tiny config's real steps (the loader's workers
    too), with model FLOP/s from its counted FLOPs beside the tutorial's published numbers;
    the CUDA-graph row says it needs a GPU; with no time left, a row is skipped and said;
  - the report: report.md and report.json in --out, every line in both.
About 70 s on 2 busy cores (two compiles of the tiny model), most of it in the first run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO, child_env

from planning.rates import read_machine_file
from tools.gpu_check.report import Line

pytestmark = pytest.mark.e2e

CPU_CHECKS = {"compile = eager", "fp16 with a forced overflow", "bf16 + fused Adam",
              "activation recomputation = plain", "FSDP on a one-rank group",
              "--fsdp --enable_jit = eager FSDP"}


def gpu_check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = child_env({"TORCHINDUCTOR_COMPILE_THREADS": "1"})
    return subprocess.run([sys.executable, "-m", "tools.gpu_check", "--device", "cpu", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_checks_that_mean_something_on_a_cpu_pass_there_and_are_reported(tmp_path):
    proc = gpu_check("--ladder_rows", "2", "--out", str(tmp_path / "report"), timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    lines = [Line(**line) for line in report["lines"]]
    by_name = {(line.section, line.name): line for line in lines}
    for name in CPU_CHECKS:
        line = by_name[("checks", name)]
        assert line.status == "ok", (name, line.number, line.detail)
    assert by_name[("checks", "eager step = CUDA-graph replay")].detail == \
        "CUDA-graph capture needs a GPU"
    assert by_name[("checks", "TF32")].status == "skip"
    overflow = by_name[("checks", "fp16 with a forced overflow")].data
    assert overflow["skipped"] and overflow["halved"] and overflow["scale"] == 65536
    assert by_name[("checks", "--fsdp --enable_jit = eager FSDP")].data["graphs"] == 1
    planned = by_name[("memory", "tiny, tp 1")]
    assert planned.status == "ok" and abs(planned.data["tensors_error"]) <= 0.15, planned
    measured = by_name[("rates", "operator rates")]  # the dry run's machine file
    assert measured.status == "ok" and read_machine_file(measured.data["machine_file"])
    rows = [line for line in lines if line.section == "ladder"]
    assert [r.name for r in rows] == ["fp32, no loader workers", "+ 4 loader workers",
                                      "+ CUDA graphs"]
    for row, published in zip(rows[:2], (9.3, 12.4), strict=True):
        assert row.data["samples_per_s"] > 0 and row.data["model_tflops"] > 0, row
        assert row.data["published_a100"] == published and row.data["mfu"] is None  # CPU
    assert rows[2].detail == "CUDA-graph capture needs a GPU"
    md = (tmp_path / "report" / "report.md").read_text()
    assert md.startswith("# gpu-check report") and "every check that ran passed" in md
    for line in lines:
        assert f"| {line.name} |" in md

    spent = gpu_check("--parts", "ladder", "--ladder_rows", "1", "--budget_s", "1", "--out",
                      str(tmp_path / "spent"), timeout=120)
    assert spent.returncode == 0, (spent.stdout + spent.stderr)[-4000:]
    rows = json.loads((tmp_path / "spent" / "report.json").read_text())["lines"]
    first = next(r for r in rows if r["section"] == "ladder")
    assert first["status"] == "skip" and first["detail"].startswith("the time budget is spent")
