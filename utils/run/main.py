"""How a train script ends: user errors (bad config, data, flags) with one line, not a
traceback, once per job, and every ending with torch.distributed shut down cleanly."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from utils import comm
from utils.errors import EXIT_PREEMPTED, EXIT_USER_ERROR, UserError, from_worker
from utils.run import error_report, signals


def run_main(main: Callable[[Sequence[str]], Any], argv: Sequence[str]) -> NoReturn:
    """Run a script's `main(argv)` and exit: 0 when it returns, its own code when it calls
    sys.exit (e.g. preempted), 2 with one `error:` line for a user error (`UserError`).

    In a job of several ranks one rank prints the line (utils/run/error_report.py). A rank
    that fails only because another rank reported a user error and left (its collectives
    find the connection closed) exits 2 too, quietly. The quiet ranks leave a moment after
    the one that printed, so that torchrun's summary names that one as the root cause.

    Every such ending first shuts torch.distributed down (`comm.shutdown`). That happens
    after the `try`, where the exception and the frames its traceback held (the model, and
    the group DDP keeps) are already gone. A finished or preempted run ends on every rank
    at once, so the ranks meet at a barrier first (an error every rank raises has passed
    one already). Other exceptions are bugs: they propagate with their traceback.
    """
    code: Any = 0
    printed = True
    try:
        main(argv)
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
        error_report.linger()
    sys.exit(code)


def _report(error: Exception) -> bool:
    """Report a user error (whether this rank printed it); re-raise anything else, unless
    it only follows from another rank's user error."""
    if isinstance(error, UserError):
        return error_report.report(error)
    user_error = from_worker(error)  # a DALI worker's UserError, as a traceback in text
    if user_error is not None:
        return error_report.report(user_error)
    if comm.is_distributed() and error_report.reported_by_another_rank():
        return False  # that rank's line says what went wrong
    raise error
