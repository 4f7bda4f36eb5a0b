"""User errors (bad config, data, flags) end the program with one line, not a traceback."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from utils.checkpoint import CheckpointError
from utils.data_loader import DataError
from utils.launch_env import LaunchError
from utils.YParams import ConfigError

USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, DataError, LaunchError,
                                                CheckpointError, FloatingPointError)
EXIT_USER_ERROR = 2


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    try:
        yield
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
