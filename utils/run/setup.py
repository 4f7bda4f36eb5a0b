"""A run's start: logging on rank 0, batch sizes, seeds and the run directory, written once
for the train scripts and the benchmarks."""

from __future__ import annotations

import logging
import os
import random
import resource
from typing import Any

import numpy as np
import torch

from utils import comm
from utils.allocator import keep_freed_memory
from utils.errors import ConfigError
from utils.launch_env import LaunchEnv
from utils.run.disk import free_space
from utils.run.logging_utils import config_logger, log_to_file
from utils.run.run_dirs import choose_run, compose, create_run

log = logging.getLogger("train")


def experiment_dir(params: Any, world_size: int, device: torch.device) -> str:
    """<expdir>/<config>/<N><GPU|CPU>/<run_num>/, as in the tutorial. The first call of a
    run without `--run_num` names the run (`resolve_run_num`), on every rank."""
    if params.get("run_num") is None:
        resolve_run_num(params, world_size, device)
    return os.path.join(runs_parent(params, world_size, device), str(params.run_num))


def runs_parent(params: Any, world_size: int, device: torch.device) -> str:
    kind = "GPU" if device.type == "cuda" else "CPU"
    return os.path.join(params.expdir, params.config, f"{world_size}{kind}")


def resolve_run_num(params: Any, world_size: int, device: torch.device) -> str:
    """Name this run's directory once (utils/run/run_dirs.py): rank 0 chooses and creates
    it, every rank stores the name in params.run_num, so that everything after (checkpoints,
    TensorBoard, profiles, the benchmarks) writes into the same directory. Returns why this
    directory (for the log)."""
    choice, error = None, None
    if comm.get_world_rank() == 0:
        parent, label = runs_parent(params, world_size, device), params.get("run_label", "")
        target = parent
        try:
            choice = choose_run(parent, label, run_num=params.get("run_num"),
                                resume=params.get("resume"), environ=os.environ)
            target = os.path.join(parent, compose(choice.name, label) if choice.new
                                  else choice.name)
            if choice.new:
                choice.name = create_run(parent, choice.name, label)
        except OSError as e:
            error = _unwritable(target, parent, e)
    choice, error = comm.broadcast_from_rank0((choice, error))
    _stop_with_rank0(error)
    params.run_num = choice.name
    return choice.why


def _unwritable(path: str, near: str, e: OSError) -> str:
    return (f"cannot write the run directory {path} ({e.strerror or e}; {free_space(near)}): "
            "set LOG_DIR (or expdir in the config) to a writable directory with free space")


def _stop_with_rank0(error: str | None) -> None:
    """Every rank raises rank 0's error (already broadcast), after a last barrier."""
    if error:
        comm.settle()  # the broadcast's last traces are gone before the ranks exit
        raise ConfigError(error)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"Using GPU {torch.cuda.get_device_name(device)} (cuda:{device.index})"
    return f"CUDA not available: training on CPU with {torch.get_num_threads()} threads"


def peak_memory_gb(device: torch.device) -> float:
    """CUDA: max allocated by tensors. CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB -> GiB


def set_batch_sizes(params: Any, dp_size: int) -> None:
    """global = local x dp. A given --local_batch_size redefines the global batch."""
    if params.local_batch_size is not None:
        params.global_batch_size = params.local_batch_size * dp_size
    elif params.global_batch_size % dp_size:
        raise ConfigError(f"global_batch_size {params.global_batch_size} is not divisible by "
                          f"the data-parallel size {dp_size}")
    else:
        params.local_batch_size = params.global_batch_size // dp_size


def setup_run(params: Any, env: LaunchEnv, device: torch.device) -> str:
    """Logging on rank 0 (stdout and out.log), batch sizes, seeds, the allocator setting
    (utils/allocator.py); returns the run dir."""
    keep_freed_memory()  # no page faults on every step's fresh activations
    world_rank, world_size = comm.get_world_rank(), comm.get_world_size()
    config_logger(world_rank)
    set_batch_sizes(params, comm.get_size("dp"))
    seed_everything(params.seed)
    why = resolve_run_num(params, world_size, device) if params.get("run_num") is None \
        else "run_num given"
    exp_dir = experiment_dir(params, world_size, device)
    error = None
    if world_rank == 0:
        try:
            os.makedirs(exp_dir, exist_ok=True)
            log_to_file(os.path.join(exp_dir, "out.log"))
        except OSError as e:
            error = _unwritable(exp_dir, exp_dir, e)
    _stop_with_rank0(comm.broadcast_from_rank0(error))  # every rank stops, none waits
    if world_rank == 0:
        log.info(f"Run directory {exp_dir} ({why})")
        log.info(describe_device(device))
        log.info(f"world size {world_size} ({env.launcher} launcher), "
                 f"global batch {params.global_batch_size}, local batch {params.local_batch_size}")
        params.log(log)
    return exp_dir
