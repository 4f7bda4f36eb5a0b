"""Rank-aware logging: rank 0 prints and writes out.log; other ranks only warn."""

from __future__ import annotations

import logging
import sys

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


def log_to_file(path: str) -> None:
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter(_FORMAT))
    logging.getLogger().addHandler(handler)
