"""How a train script ends: user errors (bad config, data, flags) with one line, not a
traceback, and every ending with torch.distributed shut down cleanly."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from utils import comm
from utils.errors import EXIT_PREEMPTED, EXIT_USER_ERROR, UserError


def run_main(main: Callable[[Sequence[str]], Any], argv: Sequence[str]) -> NoReturn:
    """Run a script's `main(argv)` and exit: 0 when it returns, its own code when it calls
    sys.exit (e.g. preempted), 2 with one `error:` line for a user error (`UserError`).

    Every such ending first shuts torch.distributed down (`comm.shutdown`). That happens
    after the `try`, where the exception and the frames its traceback held (the model, and
    the group DDP keeps) are already gone. A finished or preempted run ends on every rank
    at once, so the ranks meet at a barrier first (an error every rank raises has passed
    one already). Other exceptions are bugs: they propagate with their traceback.
    """
    code: Any = 0
    try:
        main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_USER_ERROR
    except SystemExit as e:
        code = e.code
    if code in (0, None, EXIT_PREEMPTED):
        comm.settle()
    comm.shutdown()
    sys.exit(code)
