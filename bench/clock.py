"""The clock the benchmarks time steps and ceilings with.

`wall` (default): elapsed time, what a user waits for. `cpu`: CPU time of this process (all
its threads; loader worker processes are not counted), which other jobs on a shared machine
barely disturb: use it to compare settings on a busy machine (with 2 threads, one second of
wall time is up to two of CPU time, so rates are per CPU-second; ratios stay comparable).
"""

from __future__ import annotations

import time
from collections.abc import Callable

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
_now = time.perf_counter


def use(kind: str) -> None:
    global _now
    _now = CLOCKS[kind]


def now() -> float:
    return _now()
