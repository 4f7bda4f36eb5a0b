"""Named ranges in the training step, and a profiling window.

GPU: NVTX ranges plus torch.cuda.profiler.start()/stop() around the window, so that
`nsys profile -c cudaProfilerApi` captures only that window (submit_pm.sh does this when
ENABLE_PROFILING=1). CPU, or GPU without nsys: the same ranges as torch.profiler
`record_function`s, and a Chrome-trace JSON of the same window, written to
`<run dir>/profile/<PROFILE_OUTPUT>_rank<R>.<ms>.pt.trace.json` (or $TORCH_PROFILER_OUTPUT),
to open in https://ui.perfetto.dev or chrome://tracing. (TensorBoard's PyTorch profiler plugin,
torch-tb-profiler, is deprecated upstream and is not installed.)

Ranges cost nothing when profiling is off (a null context).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)


def profiling_requested(environ: Any = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get("ENABLE_PROFILING", "0") not in ("", "0", "false", "False")


class StepProfiler:
    """`with prof.range("forward"): ...` inside the step; `prof.epoch_start/epoch_end`
    around each epoch opens and closes the window on the chosen epoch."""

    def __init__(self, device: torch.device, out_dir: str, enabled: bool | None = None,
                 window_epoch: int | None = None, rank: int = 0):
        self.enabled = profiling_requested() if enabled is None else enabled
        self.device = device
        # The tutorial profiles its 4th epoch: warm-up and allocator growth are over by then.
        self.window_epoch = int(os.environ.get("PROFILE_EPOCH", window_epoch or 4))
        # submit_pm.sh sets PROFILE_WITH_NSYS=1 when it runs the job under nsys.
        self.use_nvtx = device.type == "cuda" and os.environ.get("PROFILE_WITH_NSYS") == "1"
        name = os.environ.get("PROFILE_OUTPUT", "profile")
        self.trace_dir = os.environ.get("TORCH_PROFILER_OUTPUT") or os.path.join(out_dir,
                                                                                 "profile")
        self.trace_name = f"{os.path.basename(name)}_rank{rank}"
        self.active = False
        self._torch_prof = None
        self._names: set[str] = set()  # the ranges opened in the window

    def range(self, name: str):
        if not self.active:
            return contextlib.nullcontext()
        self._names.add(name)
        if self.use_nvtx:
            return torch.cuda.nvtx.range(name)
        return torch.profiler.record_function(name)

    def epoch_start(self, epoch: int, last_epoch: int) -> None:
        if not self.enabled or epoch != min(self.window_epoch, last_epoch):
            return
        self.active = True
        if self.use_nvtx:
            torch.cuda.profiler.start()
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        handler = torch.profiler.tensorboard_trace_handler(self.trace_dir, self.trace_name)
        self._torch_prof = torch.profiler.profile(activities=activities, on_trace_ready=handler,
                                                  record_shapes=False, with_stack=False)
        with without_trace_markers():
            self._torch_prof.__enter__()
        log.info(f"Profiling epoch {epoch}")

    def epoch_end(self) -> None:
        if not self.active:
            return
        self.active = False
        if self.use_nvtx:
            torch.cuda.profiler.stop()
            log.info("Profiling window closed (nsys capture range ends here)")
            return
        with without_trace_markers():
            self._torch_prof.__exit__(None, None, None)
        log.info(f"torch.profiler trace written to {self.trace_file()} "
                 "(open it in https://ui.perfetto.dev or chrome://tracing)")
        log.info("Time per range and top operators in the window:\n" + self.summary())
        self._torch_prof = None

    def trace_file(self) -> str:
        """The newest trace of this rank (the handler adds a timestamp to the name)."""
        traces = glob.glob(os.path.join(self.trace_dir, f"{self.trace_name}.*.pt.trace.json"))
        return max(traces, key=os.path.getmtime) if traces else self.trace_dir + "/"

    def summary(self, rows: int = 12) -> str:
        """The step's named ranges, then the costliest operators, as text tables."""
        events = self._torch_prof.key_averages()
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        return range_table(events, self._names) + "\n\n" + events.table(sort_by=sort,
                                                                       row_limit=rows)


TRACE_MARKER = "USDT:"


@contextlib.contextmanager
def without_trace_markers() -> Iterator[None]:
    """Starting and stopping torch.profiler, without the marker lines its tracer (Kineto)
    writes to stderr at both: `USDT: ... profiler_start` / `profiler_stop`, hooks for
    user-space tracing tools, logged above every severity (KINETO_LOG_LEVEL could silence
    them only with Kineto's errors). The process's stderr is caught meanwhile; every other
    line is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            text = caught.read().decode(errors="replace")
            sys.stderr.write("".join(line for line in text.splitlines(keepends=True)
                                     if not line.startswith(TRACE_MARKER)))
            sys.stderr.flush()


@contextlib.contextmanager
def quiet_profile(**kwargs: Any) -> Iterator[torch.profiler.profile]:
    """`torch.profiler.profile(**kwargs)` as a context, without the tracer's marker lines."""
    prof = torch.profiler.profile(**kwargs)
    with without_trace_markers():
        prof.__enter__()
    try:
        yield prof
    finally:
        with without_trace_markers():
            prof.__exit__(None, None, None)


def range_table(events: Any, names: set[str]) -> str:
    """Time per named range (inclusive: a range's operators count in it), the per-step
    ranges `step N` summed into one row, as a share of the steps' time."""
    rows: dict[str, list[float]] = {}  # name -> [calls, total microseconds]
    for e in events:
        if e.key not in names:
            continue
        name = "step (whole)" if re.fullmatch(r"step \d+", e.key) else e.key
        row = rows.setdefault(name, [0, 0.0])
        row[0] += e.count
        row[1] += e.cpu_time_total
    steps = rows.get("step (whole)", [0, 0.0])[1] or sum(r[1] for r in rows.values()) or 1.0
    lines = [f"{'Range':<36}{'Calls':>7}{'Total ms':>12}{'ms/call':>10}{'% of step':>11}"]
    for name, (calls, total) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{name:<36}{calls:>7}{total / 1e3:>12.1f}{total / 1e3 / calls:>10.2f}"
                     f"{100 * total / steps:>10.1f}%")
    return "\n".join(lines)
