"""Errors a user can fix (a bad flag, config, data file, launch or checkpoint), and exit codes.

A leaf module: everything may import it, it imports nothing of the project. `run_main`
(training/script_exit.py) prints any `UserError` as one `error: ...` line and exits with
EXIT_USER_ERROR; anything else is a bug and keeps its traceback.

In a job of several processes the line is printed once (training/script_exit.py): an error
that every rank raises alike (`every_rank`: a config error, or one raised after the ranks
agreed on it) by rank 0, any other by the first rank that fails.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2  # a UserError: the message says what to change
EXIT_PREEMPTED = 3   # stopped by SIGUSR1/SIGTERM: a checkpoint was written, or nothing to save


class UserError(ValueError):
    """Base of the errors whose one-line message tells the user what to change.

    `every_rank=True` says that every rank of a job raises this same error (the ranks agreed
    on it, or it follows from the config they all read): then rank 0 alone prints it.
    """

    every_rank = False
    # Seconds a rank other than 0 stays silent before printing this error: rank 0 is
    # expected to report the same failure, and the launcher then ends this rank
    # (distributed/rendezvous.py). A stop signal meanwhile means exactly that: it stays silent.
    defer = 0.0

    def __init__(self, *args: object, every_rank: bool | None = None):
        super().__init__(*args)
        if every_rank is not None:
            self.every_rank = every_rank


class ConfigError(UserError):
    """A bad config file, name, value or flag: every rank reads the same ones."""

    every_rank = True


class DataError(UserError):
    """Bad data directory, file layout, statistics or sample."""


class LaunchError(UserError):
    """An inconsistent launcher environment (torchrun, SLURM, mpirun)."""


class CheckpointError(UserError):
    """An unreadable, incompatible or unwritable checkpoint; the message names the file."""


class DivergedError(UserError, FloatingPointError):
    """The training loss or the parameters became NaN/inf; nothing was saved after it."""

    every_rank = True  # found by an all-reduce: every rank raises it at the same step


def message_of(error: BaseException) -> str:
    """The one-line message of `error`, also when a data-loader worker raised it.

    A PyTorch DataLoader worker's exception reaches the training process re-raised as the
    same type, with a message of its own: "Caught DataError in DataLoader worker process
    0.", then the worker's traceback, whose last line is "<module>.<Type>: <message>".
    That last line's message is what the user needs.
    """
    found = _last_traceback_line(str(error))
    return found[1] if found else str(error)


def from_worker(error: BaseException) -> UserError | None:
    """The UserError a worker process raised, if `error` carries its traceback as text.

    DALI's worker processes send back any exception as a RuntimeError holding the worker's
    traceback: the type is lost, but the traceback's last line still names it."""
    found = _last_traceback_line(str(error))
    if found is None:
        return None
    cls = _USER_ERRORS.get(found[0])
    return cls(found[1]) if cls is not None else None


def _last_traceback_line(text: str) -> tuple[str, str] | None:
    """("DataError", message) from a traceback's last line "utils.errors.DataError: ..."."""
    if "Traceback (most recent call last)" not in text:
        return None
    last = text.rstrip().splitlines()[-1]
    name, sep, message = last.partition(": ")
    if not sep:
        return None
    return name.rsplit(".", 1)[-1], message


_USER_ERRORS = {cls.__name__: cls for cls in (UserError, ConfigError, DataError, LaunchError,
                                              CheckpointError, DivergedError)}
