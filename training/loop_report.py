"""What the training loop measures about itself, in one object the loop wraps each step in:
the time to this process's first step and torch.compile's share of it (`StartupReport`),
the memory of its second step beside the planner's estimate, and the compile total at the
end. Each is one log line (tests and tools/tutorial_walk.py read them).

    report = LoopReport(run, step, memory_line=planning.memory.step_memory_line)
    with report.around_step(progress):
        loss = step(run, inp, tar)
    report.at_end()

The planner's estimate comes in as `memory_line`: the planner traces this package's own step
(planning/ imports training/, never the other way round).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from training.compile_cost import StartupReport
from training.progress import Progress
from training.run import Training
from training.setup import reset_peak_memory
from training.step import Step

log = logging.getLogger("train")


class LoopReport:
    """`around_step` before and after each step; `at_end` once the run is done."""

    def __init__(self, run: Training, step: Step, memory_line: Callable[..., str]):
        self.run, self.training_step, self.memory_line = run, step, memory_line
        self.startup = StartupReport(run.cfg)
        self.measured = run.progress.iters + 2  # this process's second step (a resume's too)

    @contextmanager
    def around_step(self, progress: Progress) -> Iterator[None]:
        """Around the step that `progress` counts next: its peak memory measured alone if it
        is the second (warm now: compiled, Adam's state made), the start-up line after the
        first. Nothing is logged for a step that raised."""
        run, done = self.run, progress.iters + 1
        if done == self.measured:
            reset_peak_memory(run.device)  # so the peak is this step's own
        yield
        self.startup.after_step(run.log, done)  # time to first step, compile time
        if done == self.measured:  # its peak beside the planner's estimate
            how, memory = self.training_step.measured_memory(run.device)
            log.info(self.memory_line(run.cfg, run.layout, run.ctx.local_batch_size,
                                      run.ctx.precision.mode, memory, done, how))

    def at_end(self) -> None:
        self.startup.at_end()  # the compile total: any compile after step 1 shows here
