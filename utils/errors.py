"""Errors a user can fix (a bad flag, config, data file, launch or checkpoint), and exit codes.

A leaf module: everything may import it, it imports nothing of the project. `run_main`
(utils/run/main.py) prints any `UserError` as one `error: ...` line and exits with
EXIT_USER_ERROR; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2  # a UserError: the message says what to change
EXIT_PREEMPTED = 3   # stopped by SIGUSR1/SIGTERM after saving a checkpoint


class UserError(ValueError):
    """Base of the errors whose one-line message tells the user what to change."""


class ConfigError(UserError):
    """A bad config file, name, value or flag."""


class DataError(UserError):
    """Bad data directory, file layout or statistics."""


class LaunchError(UserError):
    """An inconsistent launcher environment (torchrun, SLURM, mpirun)."""


class CheckpointError(UserError):
    """An unreadable, incompatible or unwritable checkpoint; the message names the file."""


class DivergedError(UserError, FloatingPointError):
    """The training loss or the parameters became NaN/inf; nothing was saved after it."""
