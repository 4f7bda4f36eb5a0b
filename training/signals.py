"""SIGUSR1 and SIGTERM from a train script's first line on: never the default action, which
ends the process without a word (exit 138 or 143).

Light on purpose (no torch): every script's start-up (training/startup.py) calls
`stop_during_startup()` before its heavy imports, so only the Python interpreter's own
start-up (tens of milliseconds) is left unprotected. A training run has two phases:

  start-up  (imports, process groups, model, data; nothing to save yet): a signal ends the
            process at once with "stopped by SIGUSR1 before training started: nothing to
            save" on stderr and exit code 3 (EXIT_PREEMPTED). A watcher thread does this,
            not the Python handler: Python runs a handler only between bytecodes, so while
            the main thread waits inside C++ (the torch.distributed rendezvous, a collective
            with a rank that is gone) the handler would wait too, up to the time-out. The
            signal's C-level handler writes its number to a pipe (`signal.set_wakeup_fd`),
            which the thread reads whatever the main thread is doing.
  training  (`end_startup()`, called when the run's StopSignal is made): the handler only
            records the signal; the run guard saves a checkpoint at the next step and exits 3
            (training/preemption.py).
inference.py has nothing to save at any point: it stays in the first phase to the end,
saying that the evaluation stopped before it finished.
"""

from __future__ import annotations

import os
import signal
import threading

from utils.errors import EXIT_PREEMPTED

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

_received: int | None = None
_installed: set[int] = set()
_pipe: tuple[int, int] | None = None  # (read, write) ends while the start-up watcher runs
_NUDGE = b"\0"  # not a signal number: tells the watcher to stand down
BEFORE_TRAINING = "before training started: nothing to save"


def _record(signum: int, frame: object) -> None:
    # Only a flag: stopping here, mid-step or inside a collective, would leave other ranks
    # waiting. Logging from a signal handler is not safe either.
    global _received
    _received = signum


def catch(signals: tuple[int, ...] = STOP_SIGNALS) -> None:
    """Record `signals` instead of dying of them (idempotent)."""
    for sig in signals:
        if sig not in _installed:
            signal.signal(sig, _record)
            _installed.add(sig)


def received() -> int | None:
    """The last stop signal received, or None."""
    return _received


def stop_during_startup(stopped: str = BEFORE_TRAINING) -> None:
    """From now until `end_startup()`, a stop signal ends the process at once with one line,
    "stopped by SIGTERM <stopped>", and exit code 3 (nothing is saved yet, nothing is lost).
    Call from the main thread."""
    global _pipe
    catch()
    if _pipe is not None:
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # a full pipe must never block the signal handler
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    _pipe = (read_end, write_end)
    threading.Thread(target=_watch, args=(read_end, stopped), name="startup-signal-watcher",
                     daemon=True).start()


def end_startup() -> None:
    """Training starts (or the script is ending): stop signals only set the flag from now."""
    global _pipe
    if _pipe is None:
        return
    signal.set_wakeup_fd(-1)
    _, write_end = _pipe
    _pipe = None
    os.write(write_end, _NUDGE)  # wakes the watcher, which closes the read end
    os.close(write_end)


def _watch(read_end: int, stopped: str) -> None:
    while _pipe is not None:
        data = os.read(read_end, 64)  # signal numbers, one byte each (or the nudge)
        stop = [s for s in data if s in STOP_SIGNALS]
        if _pipe is None or _NUDGE in data or not data:  # start-up is over
            break
        if stop:  # other signals (SIGINT: KeyboardInterrupt) keep their own handling
            rank = os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
            who = f"rank {rank}: " if rank is not None and _world_size() > 1 else ""
            name = signal.Signals(stop[0]).name
            os.write(2, f"{who}stopped by {name} {stopped}\n".encode())
            os._exit(EXIT_PREEMPTED)  # nothing to save: skip the interpreter's clean-up
    os.close(read_end)


def _world_size() -> int:
    size = os.environ.get("WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or "1"
    return int(size) if size.isdigit() else 1
