"""How a train script ends: user errors (bad config, data, flags) with one line, not a
traceback, once per job, and every ending with torch.distributed shut down cleanly.

One `error:` line per job, not one per rank.

A job of N processes that fails on a user error should say so once, from the rank that
failed first, and not N times with the lines running into each other. The ranks agree
through the job's key-value store (the TCPStore that torch.distributed's rendezvous made,
hosted by torchrun's agent or by rank 0), not through a collective: a rank that fails is
out of step with the others, which may be waiting in another collective, and two
mismatched collectives would hang or mix up their data.

  - An error every rank raises alike (`UserError.every_rank`: a config error, or one the
    ranks agreed on by a collective) is printed by rank 0. Another rank waits a moment for
    rank 0's claim, and prints it itself only if none comes while the store answers.
  - Any other user error is printed by the first rank to claim the store's key, as
    `error: rank k: ...`; the others stay silent.
  - A rank that then fails because its peer has gone (a collective on a closed connection)
    sees that a peer has reported and exits quietly instead of printing a traceback.
  - An error with a `defer` (a failed rendezvous, distributed/rendezvous.py) is printed by a rank
    other than 0 only if that rank is still running `defer` seconds later: rank 0 reports
    the same failure, and the launcher then ends the other ranks.
  - No store (before the process group exists, or its host has exited): the rank prints.
    Before the process group exists the ranks have read the same config and flags, so an
    `every_rank` error is left to rank 0.
  - The silent ranks leave `LINGER` seconds after the one that printed: launchers report the
    first process to exit as the root cause. A rank the launcher is already stopping
    leaves at once."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch.distributed as dist

from distributed import comm
from distributed.launch_env import resolve_launch_env
from training import signals
from utils.errors import EXIT_PREEMPTED, EXIT_USER_ERROR, UserError, from_worker, message_of

T = TypeVar("T")


def run_main(main: Callable[[T], Any], started: T) -> NoReturn:
    """Run a script's `main(started)` (`started`: what training/startup.py's `start` read
    from the command line) and exit: 0 when it returns, its own code when it calls sys.exit
    (e.g. preempted), 2 with one `error:` line for a user error (`UserError`).

    In a job of several ranks one rank prints the line (training/py). A rank
    that fails only because another rank reported a user error and left (its collectives
    find the connection closed) exits 2 too, quietly. The quiet ranks leave a moment after
    the one that printed, so that torchrun's summary names that one as the root cause.

    Every such ending first shuts torch.distributed down (`comm.shutdown`). That happens
    after the `try`, where the exception and the frames its traceback held (the model, and
    the group DDP keeps) are already gone. A finished or preempted run ends on every rank
    at once, so the ranks meet at a barrier first (an error every rank raises has passed
    one already). Other exceptions are bugs: they propagate with their traceback, and the
    process groups end with the interpreter. So whatever else holds a communicator is
    released by `main` itself, in a `finally` that runs first on every ending
    (train_mp_graphs.py: its CUDA graph, which NCCL would otherwise wait for).
    """
    code: Any = 0
    printed = True
    try:
        main(started)
    except SystemExit as e:
        code = e.code
    except Exception as e:
        signals.end_startup()  # ending anyway: a stop signal now must not add a line
        printed = _report(e)
        code = EXIT_USER_ERROR
    if code in (0, None, EXIT_PREEMPTED):
        comm.settle()
    comm.shutdown()
    if not printed:  # only ever in a job of several ranks
        linger()
    sys.exit(code)


def exit_on_user_error(error: UserError) -> NoReturn:
    """End a job whose command line or config is wrong (training/startup.py, before torch
    and any process group): one line from rank 0, as `run_main` says it, and exit code 2."""
    signals.end_startup()
    if not report(error):
        linger()
    sys.exit(EXIT_USER_ERROR)


def _report(error: Exception) -> bool:
    """Report a user error (whether this rank printed it); re-raise anything else, unless
    it only follows from another rank's user error."""
    if isinstance(error, UserError):
        return report(error)
    user_error = from_worker(error)  # a DALI worker's UserError, as a traceback in text
    if user_error is not None:
        return report(user_error)
    if comm.is_distributed() and reported_by_another_rank():
        return False  # that rank's line says what went wrong
    raise error


KEY = "user_error_reported_by_rank"
STORE_TIMEOUT = timedelta(seconds=10)
WAIT_FOR_RANK0 = 5.0  # seconds a rank waits for rank 0 to claim an every-rank error
LINGER = 3.0  # seconds a quiet rank waits before it exits


def _rank_and_world() -> tuple[int, int]:
    if comm.is_distributed():
        return comm.get_world_rank(), comm.get_world_size()
    try:  # before the process group exists: what the launcher says
        env = resolve_launch_env()
    except UserError:
        return 0, 1
    return env.rank, env.world_size


def _store() -> dist.Store | None:
    """The job's key-value store, or None when there is none (yet) or it is unusable."""
    if not comm.is_distributed():
        return None
    try:
        # The default group's store: torch has no public accessor for it.
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(STORE_TIMEOUT)
        return store
    except Exception:  # noqa: BLE001 - no store is an answer, not a failure
        return None


def _claim(store: dist.Store, rank: int) -> int | None:
    """The first rank to claim the report (this one, if nobody had); None on no answer."""
    try:
        return int(store.compare_set(KEY, "", str(rank)))
    except Exception:  # noqa: BLE001 - the store's host is gone
        return None


def _claimed(store: dist.Store) -> bool | None:
    """Whether some rank has claimed the report; None when the store does not answer."""
    try:
        return store.check([KEY])
    except Exception:  # noqa: BLE001 - the store's host is gone
        return None


def should_print(error: UserError) -> bool:
    """Whether this rank prints `error` (exactly one rank of a job does)."""
    rank, world = _rank_and_world()
    if world == 1:
        return True
    store = _store()
    if error.every_rank:
        if rank == 0:
            if store is not None:
                _claim(store, 0)
            return True
        if store is None:
            return False  # before the process group: rank 0 read the same config
        deadline = time.monotonic() + WAIT_FOR_RANK0
        while time.monotonic() < deadline:
            if _claimed(store) is not False:  # claimed, or rank 0 (the store's host) has
                return False                  # already printed and left
            time.sleep(0.05)
        return True  # rank 0 said nothing: better this rank than none
    if store is None:
        return True
    first = _claim(store, rank)
    return first is None or first == rank


def error_line(error: UserError) -> str:
    """`error: <message>`; a rank-local error in a job of several ranks names the rank."""
    rank, world = _rank_and_world()
    who = f"rank {rank}: " if world > 1 and not error.every_rank else ""
    return f"error: {who}{message_of(error)}"


def _outwaited(error: UserError) -> bool:
    """Wait up to `error.defer` seconds on a rank other than 0; True when a stop signal came
    meanwhile (the launcher ends the job because rank 0 has reported the failure)."""
    if error.defer <= 0 or _rank_and_world()[0] == 0:
        return False
    return _stopped_within(error.defer)


def _stopped_within(seconds: float) -> bool:
    """Wait up to `seconds`, or until a stop signal comes (True). Polled: a plain sleep would
    resume after the signal's handler and wait the whole time anyway."""
    deadline = time.monotonic() + seconds
    while signals.received() is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def report(error: UserError) -> bool:
    """Print `error`'s one line on stderr if this rank is the one to print it (True)."""
    if not should_print(error) or _outwaited(error):
        return False
    # A flag argparse cannot parse (utils/config.py): its usage line and name first.
    usage, prefix = getattr(error, "usage", ""), getattr(error, "prefix", "")
    print(f"{usage}{prefix}{error_line(error)}", file=sys.stderr, flush=True)
    return True


def linger(seconds: float = LINGER) -> None:
    """A rank that stays quiet leaves after the one that printed: launchers name the first
    process to exit as the failure's root cause (torchrun's summary, srun's message). One
    that a stop signal reaches, before or while it waits, leaves at once: the launcher is
    already ending the job (that first process has exited), and it kills what is still
    running a few seconds later (SLURM's KillWait), which would turn exit code 2 into 137."""
    _stopped_within(seconds)


def reported_by_another_rank() -> bool:
    """Whether another rank of this job has already reported a user error: then this rank's
    own failure (e.g. a collective whose peer has exited) is a consequence, not news."""
    store = _store()
    if store is None or not _claimed(store):  # no store, no claim, or no answer
        return False
    try:
        return int(store.get(KEY)) != comm.get_world_rank()
    except Exception:  # noqa: BLE001
        return False
