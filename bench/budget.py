"""A benchmark's time budget: how long is left, what one round of the settings set up so
far costs, and an alarm that interrupts a set-up (a long torch.compile) that would eat the
time the measurements need."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from training.compile_cost import process_age


class OverBudget(Exception):
    """Raised by `Budget.alarm` when its time is up."""


class Budget:
    def __init__(self, seconds: float):
        self.seconds = seconds
        # Counted from the process's start: interpreter and torch import included.
        self.start = time.perf_counter() - process_age()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        """Seconds left, less 5 for the report and the teardown (loaders, interpreter)."""
        return self.seconds - 5.0 - self.elapsed()

    @staticmethod
    def reserve(runners: list[Any], iters: int) -> float:
        """Seconds one measurement round of `runners` takes: per setting its bare and full
        blocks, the loader's untimed steps, its two ceilings (~1.5 steps) and 0.3 s of n^3
        matmuls; from each setting's warm-up step time."""
        return sum((2 * iters + r.prefetched + 1.5) * r.step_s + 0.3 for r in runners)

    def fitting_iters(self, runners: list[Any], iters: int) -> int:
        """At most `iters` timed steps per block; fewer (at least 1) where one round of the
        settings' steps would not fit the time left (an emulated precision's slow steps)."""
        fit = iters
        while fit > 1 and self.reserve(runners, fit) > self.left():
            fit -= 1
        if fit < iters:
            print(f"  {fit} timed step(s) per block instead of --iters {iters}: a round of "
                  f"{iters} would overrun --budget_s", file=sys.stderr, flush=True)
        return fit

    @staticmethod
    def split_cost(runners: list[Any]) -> float:
        """Seconds the profiled time split of `runners` takes (2 profiled steps, the
        profiler's overhead, the ceiling's own split)."""
        return sum(4.5 * r.step_s for r in runners)

    @contextlib.contextmanager
    def alarm(self, seconds: float) -> Iterator[None]:
        """Raise OverBudget in the body after `seconds` (main thread, POSIX; elsewhere no
        alarm)."""
        if not hasattr(signal, "setitimer") or threading.current_thread() is not \
                threading.main_thread():
            yield
            return
        if seconds <= 0:
            raise OverBudget

        def expire(signum: int, frame: Any) -> None:
            raise OverBudget

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        except Exception as e:  # torch.compile may wrap it in its own exception
            if isinstance(e, OverBudget) or _caused_by_alarm(e):
                raise OverBudget from None
            raise
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _caused_by_alarm(e: BaseException | None) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OverBudget):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False
