"""Rank-aware logging: rank 0 prints and writes out.log; other ranks only warn."""

from __future__ import annotations

import logging
import os
import sys

from utils.run.disk import probe_space

_FORMAT = "%(asctime)s - %(name)s - %(levelname)s - %(message)s"


def config_logger(rank: int = 0) -> logging.Logger:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(_FORMAT))
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    for noisy in ("matplotlib", "PIL", "h5py"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return root


class RunLogFile(logging.FileHandler):
    """out.log. A write that fails (the disk filled up during the run) is reported once on
    stderr and the file is closed: logging's default would print a "--- Logging error ---"
    block with a traceback for every line logged from then on."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        print(f"warning: cannot write {self.baseFilename} ({error}); log lines go to the "
              "console only from now on", file=sys.stderr, flush=True)
        logging.getLogger().removeHandler(self)
        try:
            self.close()
        except OSError:
            pass


def log_to_file(path: str) -> None:
    """Log to `path` as well, once a test write in its directory shows that there is room
    (OSError otherwise, e.g. ENOSPC on a full disk)."""
    probe_space(os.path.dirname(path) or ".")
    handler = RunLogFile(path, mode="a")
    handler.setFormatter(logging.Formatter(_FORMAT))
    logging.getLogger().addHandler(handler)
