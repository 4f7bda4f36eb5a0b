"""Checkpoint files on disk: where they live, atomic writes, keep-K, the bytes checked
before use, and which one `--resume` takes.

Files: <exp_dir>/checkpoints/ckpt_<iters:08d>.pt; the newest intact one is the one
`--resume` (auto) takes. A save writes `<name>.tmp.<pid>`, fsyncs it and renames it over
`<name>`: a crash or kill mid-save leaves every earlier file intact (only the stray .tmp
file, removed by the next save). A run that starts afresh, or resumes from an older
checkpoint, in a directory holding later checkpoints moves those to
checkpoints/superseded-<time>/ first, so that only its own files are kept and resumed.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import time
import zipfile
from typing import Any

import torch

from distributed import comm
from distributed.launch_env import slurm_restarts
from utils.errors import CheckpointError

log = logging.getLogger(__name__)

def checkpoint_dir(exp_dir: str) -> str:
    return os.path.join(exp_dir, "checkpoints")


def list_checkpoints(exp_dir: str) -> list[str]:
    """Complete checkpoints, oldest first (temporary files are never listed)."""
    return sorted(glob.glob(os.path.join(checkpoint_dir(exp_dir), "ckpt_*.pt")))


def latest_checkpoint(exp_dir: str) -> str | None:
    files = list_checkpoints(exp_dir)
    return files[-1] if files else None


def checkpoint_iteration(path: str) -> int:
    m = re.search(r"ckpt_(\d+)\.pt$", path)
    return int(m.group(1)) if m else -1


def set_aside_newer(exp_dir: str, iters: int) -> str | None:
    """Move this run directory's checkpoints beyond iteration `iters` into
    checkpoints/superseded-<time>/ (nothing is deleted); returns that directory.

    They belong to a timeline the starting run abandons: an earlier run in the same
    directory (a fresh start in a directory reused by `--run_num`, or a SLURM restart
    without `--requeue`) or the part after an older checkpoint it resumes from
    (`--resume PATH`). A new run without `--run_num` has a directory of its own
    (training/run_dirs.py), so there is nothing to set aside. Left in
    place, keep-K would delete the new run's files in their favour (names sort by iteration)
    and `--resume` (auto) would pick them up after the next interruption.
    """
    newer = [f for f in list_checkpoints(exp_dir) if checkpoint_iteration(f) > iters]
    if not newer:
        return None
    target = os.path.join(checkpoint_dir(exp_dir),
                          "superseded-" + time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(target, exist_ok=True)
    for f in newer:
        os.replace(f, os.path.join(target, os.path.basename(f)))
    log.warning(f"Moved {len(newer)} checkpoint(s) after iteration {iters} of an earlier run "
                f"to {target}")
    return target


def resolve_resume(resume: str | None, exp_dir: str, requeue: bool = False) -> str | None:
    """The checkpoint to start from: `--resume PATH`, `--resume` / `--resume auto` (the
    newest in the run directory; none there -> start from scratch, with a log line), or None.

    With `--requeue`, a run that SLURM restarted (SLURM_RESTART_COUNT > 0) resumes as if
    `--resume auto` had been given. Rank 0 decides and tells the others, so that every rank
    loads the same file even if a save lands while they look.
    """
    choice, error = None, None
    if comm.get_world_rank() == 0:
        restarts = slurm_restarts()
        if resume is None and requeue and restarts > 0:
            log.info(f"SLURM restart {restarts} of a --requeue job: resuming")
            resume = "auto"
        if resume == "auto":
            try:
                choice = newest_intact_checkpoint(exp_dir)
            except CheckpointError as e:
                error = str(e)
            if choice is None and error is None:
                log.info(f"--resume: no checkpoint in {checkpoint_dir(exp_dir)}, "
                         "starting from scratch")
        else:
            choice = resume
    choice, error = comm.broadcast_from_rank0((choice, error))
    if error:  # every rank stops, with rank 0's message
        raise CheckpointError(error, every_rank=True)
    return choice


def newest_intact_checkpoint(exp_dir: str) -> str | None:
    """The newest checkpoint whose bytes are intact (`damage`); a damaged one (cut short by
    a full disk, a bit flipped on the way) is skipped with a warning. None: there are no
    checkpoints; CheckpointError: there are, but none is intact."""
    files = list_checkpoints(exp_dir)
    for path in reversed(files):
        problem = damage(path)
        if problem is None:
            return path
        log.warning(f"--resume: skipping {path}, it is damaged: {problem}")
    if not files:
        return None
    raise CheckpointError(f"--resume: none of the {len(files)} checkpoints in "
                          f"{checkpoint_dir(exp_dir)} is intact (see the warnings above); "
                          "resume from a copy with --resume PATH, or start afresh")


def save_atomic(obj: dict[str, Any], path: str) -> None:
    """Write `obj` to `path` so that `path` is either the old file or the complete new one."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    try:  # make the rename itself durable (a power cut right after must not lose it)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # some file systems cannot fsync a directory; the rename still happened
        pass


def prune(exp_dir: str, keep: int) -> None:
    """Keep the newest `keep` checkpoints; remove temporary files of interrupted saves."""
    for old in list_checkpoints(exp_dir)[:-keep] if keep > 0 else []:
        os.remove(old)
    for stray in glob.glob(os.path.join(checkpoint_dir(exp_dir), "ckpt_*.pt.tmp*")):
        if not stray.endswith(f".tmp.{os.getpid()}"):
            log.info(f"Removing {stray}, left by an interrupted save")
            os.remove(stray)


def damage(path: str) -> str | None:
    """What is wrong with the bytes of checkpoint file `path`, or None if they are intact.

    torch.save writes a zip archive with a CRC-32 of every record, and its directory at the
    end of the file: a truncated file, an empty one or random bytes are not a readable zip,
    and a flipped bit inside a tensor fails its record's CRC. torch.load checks neither, so
    a damaged checkpoint would load as garbage and the run would go on from it.
    """
    if not zipfile.is_zipfile(path):
        return (f"not a complete torch.save file ({os.path.getsize(path)} bytes; truncated, "
                "or not a checkpoint)")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every record and checks its CRC-32
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"a damaged zip archive ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    if bad is not None:
        return f"record {bad} fails its CRC check (the file was damaged after it was written)"
    return None
