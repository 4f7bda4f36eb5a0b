"""Named ranges in the training step, and a profiling window.

GPU: NVTX ranges plus torch.cuda.profiler.start()/stop() around the window, so that
`nsys profile -c cudaProfilerApi` captures only that window (submit_pm.sh does this when
ENABLE_PROFILING=1). CPU, or GPU without nsys: the same ranges as torch.profiler
`record_function`s, and a trace of the same window written for TensorBoard / Perfetto.

Ranges cost nothing when profiling is off (a null context).
"""

from __future__ import annotations

import contextlib
import logging
import os
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

    def range(self, name: str):
        if not self.active:
            return contextlib.nullcontext()
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
        self._torch_prof.__exit__(None, None, None)
        log.info(f"torch.profiler trace written to {self.trace_dir}/ "
                 "(open with `tensorboard --logdir` or ui.perfetto.dev)")
        log.info("Time per range and top operators in the window:\n" + self.summary())
        self._torch_prof = None

    def summary(self, rows: int = 12) -> str:
        """The step's named ranges and the costliest operators, as a text table."""
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        return self._torch_prof.key_averages().table(sort_by=sort, row_limit=rows)
