"""ENABLE_PROFILING=1 on CPU: a torch.profiler trace of the chosen window, with the same
range names the GPU path gives Nsight Systems through NVTX."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

RANGES = ("forward", "backward", "optimizer", "data copy in")


def test_profiled_tiny_run_writes_a_trace_with_the_step_ranges(run_train):
    run = run_train("train.py", ["--config=tiny", "--num_iters=8"],
                    env_extra={"ENABLE_PROFILING": "1", "PROFILE_OUTPUT": "tinyprof",
                               "PROFILE_EPOCH": "1"})
    assert run.returncode == 0, run.output
    traces = list((run.exp_dir("tiny") / "profile").glob("tinyprof_rank0*.pt.trace.json"))
    assert len(traces) == 1, traces
    # The log names the file itself, so a user can paste it into the viewer.
    logged = re.search(r"torch.profiler trace written to (\S+) \(open it in", run.output)
    assert logged and Path(logged.group(1)) == traces[0], run.output[-2000:]
    events = json.loads(traces[0].read_text())["traceEvents"]
    # Chrome trace event format, what Perfetto and chrome://tracing read: complete events
    # ("ph": "X") with a start and a duration in microseconds.
    ranges = [e for e in events if e.get("name") in RANGES]
    assert ranges and all(e["ph"] == "X" and e["dur"] >= 0 and e["ts"] > 0 for e in ranges)
    names = {e.get("name") for e in events}
    for name in RANGES:
        assert name in names, f"range '{name}' missing from the trace"
    assert sum(1 for n in names if n and n.startswith("step ")) == 8  # one range per step
    assert "Time per range and top operators" in run.output
    assert "USDT" not in run.output  # the profiler's tracer markers (profiler_start/stop)
    # The summary's first table is the named ranges (not aten operators): the 8 steps as
    # one row, then each range of the step, each called once per step.
    table = run.output.split("Time per range and top operators in the window:\n")[1]
    header, *rows = table.split("\n\n")[0].splitlines()
    assert header.split()[:2] == ["Range", "Calls"], table[:2000]
    named = {" ".join(r.split()[:-4]): int(r.split()[-4]) for r in rows}
    assert named == {"step (whole)": 8, **{name: 8 for name in RANGES}}, rows
    assert rows[0].startswith("step (whole)") and rows[0].rstrip().endswith("100.0%")


def test_without_profiling_no_trace_is_written(run_train):
    run = run_train("train.py", ["--config=tiny", "--num_iters=4"])
    assert run.returncode == 0, run.output
    assert not (run.exp_dir("tiny") / "profile").exists()
