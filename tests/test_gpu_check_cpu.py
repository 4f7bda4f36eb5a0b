"""The gpu-check run on a CPU, as a user runs it (`python -m tools.gpu_check --device cpu`), for
the checks that mean something there (tools/gpu_check/checks.py says what each proves):

  - compile = eager, fp16 with a forced overflow (the step skipped, the scale halved), bf16 +
    fused Adam (on a CPU that runs bf16 natively; elsewhere it says it needs one), recompute
    = plain, FSDP on a one-rank group, `--fsdp --enable_jit` = eager FSDP (one graph, no
    break) pass; the CUDA-graph replay and TF32 say they need a GPU;
  - memory: the planner's tensors within 15 % of the allocations the profiler measures
    (the tiny config);
  - rates: the operator rates measured (small shapes) into a machine file the dry run reads;
  - the ladder's first two rows time the tiny config's real steps (the loader's workers
    too), with model FLOP/s from its counted FLOPs beside the tutorial's published numbers;
    the CUDA-graph row says it needs a GPU; with no time left, a row is skipped and said;
  - recompute trains as the plain model at a lower peak of the tensors alive (the
    profiler's allocation events);
  - the report: report.md and report.json in --out, every line in both;
  - a row that raises (a training file cut short) is its FAIL line, the rows after it
    still run and the report is written;
  - the GPU branch's start-up (`--device cuda`, main() called past the preflight) gets a
    GPU with its index: `torch.cuda.set_device`'s argument check passes and the start
    fails where CUDA itself is needed, as its FAIL line, with every other part said as not
    run and the report written.
About 100 s on 2 busy cores (two compiles of the tiny model), most of it in the first run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, child_env

from planning.rates import read_machine_file
from tools.gpu_check.environment import supports
from tools.gpu_check.report import Line

pytestmark = pytest.mark.e2e

CPU_CHECKS = {"compile = eager", "fp16 with a forced overflow", "bf16 + fused Adam",
              "activation recomputation = plain", "FSDP on a one-rank group",
              "--fsdp --enable_jit = eager FSDP"}


def gpu_check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = child_env({"TORCHINDUCTOR_COMPILE_THREADS": "1"})
    return subprocess.run([sys.executable, "-m", "tools.gpu_check", "--device", "cpu", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def report_lines(out: Path) -> dict[tuple[str, str], Line]:
    lines = [Line(**line) for line in json.loads((out / "report.json").read_text())["lines"]]
    return {(line.section, line.name): line for line in lines}


def test_the_checks_that_mean_something_on_a_cpu_pass_there_and_are_reported(tmp_path):
    proc = gpu_check("--ladder_rows", "2", "--out", str(tmp_path / "report"), timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    lines = [Line(**line) for line in report["lines"]]
    by_name = {(line.section, line.name): line for line in lines}
    native_bf16 = supports(torch.device("cpu"))["bf16"]
    for name in CPU_CHECKS:
        line = by_name[("checks", name)]
        if name == "bf16 + fused Adam" and not native_bf16:  # emulated: too slow to mean much
            assert (line.status, line.detail) == ("skip", "no native bf16 on cpu"), line
            continue
        assert line.status == "ok", (name, line.number, line.detail)
    assert by_name[("checks", "eager step = CUDA-graph replay")].detail == \
        "CUDA-graph capture needs a GPU"
    assert by_name[("checks", "TF32")].status == "skip"
    overflow = by_name[("checks", "fp16 with a forced overflow")].data
    assert overflow["skipped"] and overflow["halved"] and overflow["scale"] == 65536
    assert by_name[("checks", "--fsdp --enable_jit = eager FSDP")].data["graphs"] == 1
    recompute = by_name[("checks", "activation recomputation = plain")].data["peak_mib"]
    assert 0 < recompute["blocks"] < recompute["none"], recompute
    planned = by_name[("memory", "tiny, tp 1")]
    assert planned.status == "ok" and abs(planned.data["tensors_error"]) <= 0.15, planned
    measured = by_name[("rates", "operator rates")]  # the dry run's machine file
    assert measured.status == "ok" and read_machine_file(measured.data["machine_file"])
    data, *rows = [line for line in lines if line.section == "ladder"]
    assert data.name == "data set" and data.status == "info", data
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
    first = next(r for r in rows if r["section"] == "ladder" and r["name"] != "data set")
    assert first["status"] == "skip" and first["detail"].startswith("the time budget is spent")


def test_a_ladder_row_that_raises_is_its_fail_line_and_the_report_is_still_written(tmp_path):
    from data.synthetic import generate

    work = tmp_path / "work"
    data = work / "data_16x32"  # the tiny grid's, where ladder.data_set makes one once
    generate(data, img_size=(16, 32), samples_per_year=4, seed=0)
    train = next((data / "train").glob("*.h5"))
    with open(train, "r+b") as f:  # cut short, as a full disk or a broken copy leaves it
        f.truncate(train.stat().st_size // 2)
    proc = gpu_check("--parts", "ladder", "--ladder_rows", "2", "--work", str(work), "--out",
                     str(tmp_path / "report"), timeout=120)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    by_name = report_lines(tmp_path / "report")
    for row in ("fp32, no loader workers", "+ 4 loader workers"):  # the second ran too
        line = by_name[("ladder", row)]
        assert line.status == "FAIL" and line.detail.startswith(f"DataError: {train} is not "
                                                                "a readable HDF5 file"), line
    assert by_name[("ladder", "+ CUDA graphs")].detail == "CUDA-graph capture needs a GPU"
    md = (tmp_path / "report" / "report.md").read_text()
    assert "Result: **2 failed**: fp32, no loader workers, + 4 loader workers" in md
    assert "--- ladder: fp32, no loader workers" in (tmp_path / "report" /
                                                      "gpu-check.log").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this is make gpu-check itself")
def test_the_gpu_start_up_passes_pytorchs_index_check_and_its_failure_still_writes_the_report(
        tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from tools.gpu_check.__main__ import main; "
         "sys.exit(main(sys.argv[1:]))", "--device", "cuda", "--out", str(out)],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    by_name = report_lines(out)
    start = by_name[("environment", "start")]
    # past torch.cuda.set_device's argument check (a bare "cuda" fails there with a
    # ValueError), it fails where CUDA is needed: no CUDA in this build, or no GPU
    assert start.status == "FAIL" and "specified index" not in start.detail, start
    assert start.detail.startswith(("AttributeError", "RuntimeError", "AssertionError")), start
    assert by_name[("environment", "GPU")].status == "FAIL"
    not_run = [line for (section, _), line in by_name.items() if section != "environment"]
    # the checks, memory's two configs and its terms, the rates, the ladder's rows
    assert len(not_run) == 8 + 2 + 1 + 1 + 7
    assert {line.detail for line in not_run} == {"not run: the start-up failed (the line "
                                                 "'start')"}
    assert "Result: **2 failed**: start, GPU" in (out / "report.md").read_text()
