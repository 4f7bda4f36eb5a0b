"""What torch.compile costs a run, shown, and paid once per config rather than once per job.

- the compile cache (training/compiling.py): paid once per config, not once per job.
- `StartupReport`: after the first training step of a process, one log line (rank 0) with
  the time since the process started and how much of it was compiling, and the cache
  hits (and a warning if a run asked to compile compiled nothing); at the end of the run,
  the compile total, which shows any compile after step 1.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import psutil

from training.compiling import CACHE_ENV
from utils.config_schema import Config

log = logging.getLogger("train")

def process_age() -> float:
    """Seconds since this process started (its start time as the OS recorded it, so the
    interpreter's start and the imports count too)."""
    return time.time() - psutil.Process().create_time()


def compile_seconds() -> float:
    """Wall time spent compiling so far in this process: Dynamo's frame compiles (tracing,
    AOTAutograd, Inductor, cache look-ups) plus the backward graphs compiled lazily at the
    first backward, as torch._dynamo accounts them."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


def compile_counts() -> dict[str, int]:
    """Graphs Dynamo compiled and the FX graph cache's hits and misses in this process."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "misses": int(counters["inductor"]["fxgraph_cache_miss"])}


def describe_compile() -> str:
    c = compile_counts()
    return (f"torch.compile {compile_seconds():.1f} s for {c['graphs']} graphs (compile cache "
            f"{os.environ.get(CACHE_ENV, '?')}: {c['hits']} hits, {c['misses']} misses)")


class StartupReport:
    """Logs the cost of getting to the first step once, after the first step this process
    takes (a resumed run's first step too), and the compile total at the end."""

    def __init__(self, cfg: Config):
        self.compiled = cfg.enable_jit
        self.done = False

    def after_step(self, run_log: Any, step: int) -> None:
        if self.done:
            return
        self.done = True
        age = process_age()
        line = f"First step done {age:.1f} s after the process started"
        scalars = {"Startup/time to first step [s]": age}
        if self.compiled:
            line += f"; {describe_compile()}"
            scalars["Startup/torch.compile [s]"] = compile_seconds()
        log.info(line)
        if self.compiled and compile_counts()["graphs"] == 0:  # never a silent eager run
            log.warning("torch.compile compiled no graph by the first step: this run's model "
                        "runs eagerly (enable_jit is set); report the log")
        run_log.scalars(step, scalars)

    def at_end(self) -> None:
        if self.compiled:
            log.info(f"Whole run: {describe_compile()}")

