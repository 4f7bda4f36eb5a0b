"""torch.profiler's tracer writes marker lines (`USDT: ... profiler_start/stop`) to the
process's stderr; a run's and a benchmark's output carry none of them, and nothing else the
process writes meanwhile is lost."""

from __future__ import annotations

import os

import torch

from training.profiling import quiet_profile, without_trace_markers


def test_a_profiled_region_leaves_no_tracer_marker_lines_on_stderr(capfd):
    with quiet_profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_start" not in err and "profiler_stop" not in err, err
    assert any(e.name == "aten::mm" for e in prof.events())  # it still profiled


def test_other_stderr_lines_written_while_the_profiler_starts_pass_through(capfd):
    with without_trace_markers():
        os.write(2, b"USDT:2026-01-01 1:1 X.cpp:1] profiler_start\n")
        os.write(2, b"ERROR:2026-01-01 1:1 X.cpp:2] a real error\n")
    assert capfd.readouterr().err == "ERROR:2026-01-01 1:1 X.cpp:2] a real error\n"
