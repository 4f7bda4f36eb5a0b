"""Room on disk for a run's files: a full disk stops the run at start-up with one line
naming the directory and its free space, not hours later, or with a traceback per log line."""

from __future__ import annotations

import os
import shutil

PROBE_BYTES = 64 * 1024  # what the first minutes of logs and TensorBoard events need


def probe_space(directory: str, nbytes: int = PROBE_BYTES) -> None:
    """Write, fsync and remove `nbytes` in `directory`: a full disk or an exceeded quota
    raises OSError now (some file systems report it only at fsync)."""
    probe = os.path.join(directory, f".space_probe.{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * nbytes)
            f.flush()
            os.fsync(f.fileno())
    finally:
        if os.path.exists(probe):
            os.remove(probe)


def nearest_existing(path: str) -> str:
    """`path`, or its nearest parent directory that exists."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return path or "."


def free_bytes(path: str) -> int:
    """Free bytes on the file system that holds `path` (or would hold it)."""
    return shutil.disk_usage(nearest_existing(path)).free


def free_space(path: str) -> str:
    """"12.5 MB free" on the file system that holds `path`, for a message."""
    try:
        return f"{human_bytes(free_bytes(path))} free"
    except OSError:
        return "free space unknown"


def human_bytes(n: float) -> str:
    if n < 1000:
        return f"{n:.0f} B"
    for unit in ("kB", "MB", "GB"):
        n /= 1000
        if n < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} TB"
