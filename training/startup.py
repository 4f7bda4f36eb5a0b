"""A script's start-up, one call made before torch is imported: every script starts alike.

    cfg = start(__doc__)                                     # train.py
    cfg = start(__doc__, model_parallel=True)                # train_mp.py (+ --tp, --cp, ...)
    cfg = start(__doc__, True, script="train_mp_graphs.py")  # + its own --graph_warmup
    args = start(__doc__, parse=parse_flags, stopped=...)    # inference.py: its own flags

In this order:
  1. SIGUSR1 and SIGTERM end the process with one line from now on (training/signals.py):
     the imports and the set-up that follow take seconds, and a signal must not kill the
     run without a word;
  2. the command line: the script's flags (utils/config.py derives them from the schema)
     and the config they name, read and checked once (a frozen `Config`). A bad flag or
     value ends the job here with one `error:` line from one rank and exit code 2
     (training/script_exit.py), before anything else has started;
  3. how OpenMP's idle threads wait (utils/openmp.py), chosen by what will share the
     cores: the config's loader and its workers. libgomp reads its environment once, when
     torch loads it, so this is the last moment to set it.
Torch-free, like everything it imports.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from training import signals
from utils import openmp
from utils.config import load_config
from utils.config_schema import Config
from utils.errors import UserError


def start(description: str, model_parallel: bool = False, script: str | None = None,
          argv: Sequence[str] | None = None,
          parse: Callable[[Sequence[str], str], Any] | None = None,
          stopped: str = signals.BEFORE_TRAINING) -> Any:
    """What the command line `argv` (default: sys.argv[1:]) asks for, after stop signals and
    before OpenMP's policy are set: the checked `Config` of a train script (its flags: the
    model-parallel ones if `model_parallel`, `script`'s own), or what `parse(argv,
    description)` returns for a script with flags of its own (inference.py, whose config
    comes with its checkpoint). `stopped` ends the line a stop signal prints."""
    signals.stop_during_startup(stopped)
    argv = sys.argv[1:] if argv is None else list(argv)
    summary = description.strip().splitlines()[0]
    try:
        if parse is None:
            started = load_config(argv, summary, model_parallel, script)
        else:
            started = parse(argv, summary)
    except UserError as error:
        from training.script_exit import exit_on_user_error  # torch loads: the run ends here

        exit_on_user_error(error)
    if isinstance(started, Config):
        openmp.set_before_torch(started.num_data_workers, started.data_loader_config)
    else:  # inference.py reads its data in this process, with no loader workers
        openmp.set_before_torch(0, "pytorch")
    return started
