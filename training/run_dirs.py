"""Which directory a run writes: its name under <expdir>/<config>/<N>CPU|GPU/.

One run, one directory, one TensorBoard run. Without `--run_num` every new run gets a name
of its own, `<base>[-<label>]`:

- base: under SLURM the job id (`job1234`; a second training in the same allocation
  `job1234.1`), so that a requeued job (same id, SLURM_RESTART_COUNT > 0) finds its own
  run; elsewhere the next free number (`00`, `01`, ...).
- label: the flags that change what is trained, in a fixed order
  (`amp_mode=bf16-num_data_workers=4`, `tp=2`), so that TensorBoard's run list says which
  run is which.
  Flags that only say how long or how the run is kept (`NOT_IN_LABEL`) are left out, so a
  resumed run with a longer `--num_iters` finds the run it continues.

The directory is created with os.mkdir, which fails if it exists: two runs started at the
same moment never share one. Which run to continue: `--run_num NAME` names it (reused as it
is, as before); a SLURM restart continues its own job's run; `--resume` (auto) the run of the
same label whose checkpoint is newest; `--resume PATH` the run that holds PATH, if it is a
run of this config and world size. Anything else starts a new run.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distributed.launch_env import slurm_restarts
from training.checkpoint_files import checkpoint_dir, latest_checkpoint
from utils.errors import CheckpointError

# Config-key flags that say how long a run is or how it is kept, not what it trains (the
# CUDA graph's warm-up steps are undone before training starts).
NOT_IN_LABEL = frozenset({"run_num", "num_iters", "checkpoint_interval", "checkpoint_keep",
                          "resume", "requeue", "graph_warmup"})
MAX_LABEL = 96  # a longer label is cut and ends in a hash of the whole (names stay unique)
_NAME = re.compile(r"^(?P<base>\d+|job\d+(?:\.\d+)?)(?:-(?P<label>.+))?$")


def run_label(flags: Mapping[str, Any]) -> str:
    """`key=value` (a switch: `key`) for every given flag, joined by '-', in the order of
    `flags`; a path keeps only its file name, other characters unsafe in a directory or
    shell word become '_'."""
    parts = []
    for key, value in flags.items():
        if key in NOT_IN_LABEL or value is None or value is False:
            continue
        if value is True:
            parts.append(key)
            continue
        text = os.path.splitext(os.path.basename(value))[0] if isinstance(value, str) and \
            os.sep in value else str(value)
        parts.append(f"{key}={re.sub(r'[^A-Za-z0-9._+=]', '_', text)}")
    label = "-".join(parts)
    if len(label) > MAX_LABEL:
        label = label[:MAX_LABEL - 9] + "~" + hashlib.sha1(label.encode()).hexdigest()[:8]
    return label


def compose(base: str, label: str) -> str:
    return f"{base}-{label}" if label else base


def parse(name: str) -> tuple[str, str] | None:
    """(base, label) of a name this module gives, else None (e.g. a `--run_num` of one's own)."""
    m = _NAME.match(name)
    return (m["base"], m["label"] or "") if m else None


@dataclass
class RunChoice:
    name: str  # reused: the run's name; new: the first base to try (`create_run`)
    new: bool
    why: str  # for the log line that names the run directory


def choose_run(parent: str, label: str, *, run_num: str | None, resume: str | None,
               environ: Mapping[str, str]) -> RunChoice:
    """Which run of `parent` (= <expdir>/<config>/<N>CPU|GPU) this one is; see the module
    docstring. Looks, creates nothing."""
    if run_num is not None:
        return RunChoice(run_num, False, "--run_num")
    job = environ.get("SLURM_JOB_ID")
    restarts = slurm_restarts(environ)
    if job and restarts > 0:  # requeued: resumed with --requeue, else restarted in place
        own = _runs(parent, label, lambda base: base.split(".")[0] == f"job{job}")
        if own:
            return RunChoice(own[-1], False, f"SLURM restart {restarts} of job {job}: its "
                                             "own run")
    if resume == "auto":
        newest = newest_run_with_checkpoint(parent, label)
        if newest:
            return RunChoice(newest, False, "--resume: the run of these flags with the "
                                            "newest checkpoint")
        return RunChoice(_first_new(parent, job), True, "--resume: no earlier run of these "
                                                         "flags has a checkpoint, a new run")
    if resume is not None:
        holder = _run_holding(parent, resume)
        if holder:
            return RunChoice(holder, False, f"--resume {resume}: the run that holds it")
    return RunChoice(_first_new(parent, job), True, "a new run")


def next_name(base: str) -> str:
    """The base to try after `base` was taken: 03 -> 04, job12 -> job12.1 -> job12.2."""
    if base.isdigit():
        return f"{int(base) + 1:02d}"
    job, _, k = base.partition(".")
    return f"{job}.{int(k or 0) + 1}"


def create_run(parent: str, base: str, label: str, attempts: int = 1000) -> str:
    """Create <parent>/<base>[-label] with os.mkdir, moving to the next base while the name
    is taken (by an earlier run, or by one started at the same moment); returns the name."""
    os.makedirs(parent, exist_ok=True)
    for _ in range(attempts):
        name = compose(base, label)
        try:
            os.mkdir(os.path.join(parent, name))
            return name
        except FileExistsError:
            base = next_name(base)
    raise FileExistsError(f"{parent}: no free run name after {attempts} tries")


def newest_run_with_checkpoint(parent: str, label: str | None = None) -> str | None:
    """The name of the run of `parent` (of this label; None: any) whose newest checkpoint
    was written last, or None."""
    names = [n for n in _names(parent) if label is None or (parse(n) or ("", None))[1] == label]
    newest = newest_checkpointed([os.path.join(parent, n) for n in names])
    return os.path.basename(newest) if newest else None


def newest_checkpointed(run_dirs: list[str]) -> str | None:
    """Of these run directories, the one whose newest checkpoint was written last (None: no
    checkpoint in any). What `--resume`, inference.py --config and tools.plot_run take."""
    runs = [(os.path.getmtime(ckpt), run) for run in run_dirs
            if (ckpt := latest_checkpoint(run))]
    return max(runs)[1] if runs else None


def checkpoint_of_run(run_dir: str, flag: str = "--run_dir") -> str:
    """The newest checkpoint of the run directory `run_dir` (given by `flag`). What is
    missing, the directory or its checkpoints, is a CheckpointError that every rank of a
    job raises alike (they look at the same path), so the job prints it once."""
    if not os.path.isdir(run_dir):
        raise CheckpointError(f"no run directory {run_dir} ({flag}){runs_near(run_dir)}",
                              every_rank=True)
    path = latest_checkpoint(run_dir)
    if path is None:
        raise CheckpointError(f"no checkpoint in {checkpoint_dir(run_dir)} ({flag}): the run "
                              "has saved none yet (it saves one every checkpoint_interval "
                              "iterations and at its end)", every_rank=True)
    return path


def runs_near(path: str, levels: int = 2, shown: int = 6) -> str:
    """'; runs with checkpoints in <dir>: a, b' for the nearest existing directory above
    `path` (at most `levels` up): what a mistyped --run_dir probably meant. '' if none."""
    parent = os.path.dirname(os.path.normpath(path))
    for _ in range(levels):
        if os.path.isdir(parent or "."):
            found = sorted({os.path.relpath(os.path.dirname(os.path.dirname(c)), parent or ".")
                            for depth in ("*", os.path.join("*", "*"))
                            for c in glob.glob(os.path.join(parent or ".", depth,
                                                            "checkpoints", "ckpt_*.pt"))})
            if found:
                more = f" and {len(found) - shown} more" if len(found) > shown else ""
                return f"; runs with checkpoints in {parent}: {', '.join(found[:shown])}{more}"
            return ""
        parent = os.path.dirname(parent)
    return ""


def _names(parent: str) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(parent) if e.is_dir())
    except FileNotFoundError:
        return []


def _runs(parent: str, label: str, base_ok) -> list[str]:
    """Names given by this module with this label and an accepted base, oldest first."""
    found = []
    for name in _names(parent):
        parsed = parse(name)
        if parsed and parsed[1] == label and base_ok(parsed[0]):
            job, _, k = parsed[0].partition(".")
            found.append((int(k or 0), name))
    return [name for _, name in sorted(found)]


def _first_new(parent: str, job: str | None) -> str:
    """The first base to try for a new run: job<id>, or one past the highest number."""
    if job:
        return f"job{job}"
    numbers = [int(p[0]) for p in map(parse, _names(parent)) if p and p[0].isdigit()]
    return f"{max(numbers) + 1:02d}" if numbers else "00"


def _run_holding(parent: str, checkpoint: str) -> str | None:
    """The name of the run of `parent` whose checkpoints/ holds `checkpoint`, else None."""
    ckpt_dir = os.path.dirname(os.path.abspath(checkpoint))
    run = os.path.dirname(ckpt_dir)
    if os.path.basename(ckpt_dir) != "checkpoints" or \
            os.path.dirname(run) != os.path.abspath(parent):
        return None
    return os.path.basename(run)
