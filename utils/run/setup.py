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

log = logging.getLogger("train")


def experiment_dir(params: Any, world_size: int, device: torch.device) -> str:
    """<expdir>/<config>/<N><GPU|CPU>/<run_num>/, as in the tutorial."""
    kind = "GPU" if device.type == "cuda" else "CPU"
    return os.path.join(params.expdir, params.config, f"{world_size}{kind}", str(params.run_num))


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
    exp_dir = experiment_dir(params, world_size, device)
    error = None
    if world_rank == 0:
        try:
            os.makedirs(exp_dir, exist_ok=True)
            log_to_file(os.path.join(exp_dir, "out.log"))
        except OSError as e:
            error = f"cannot write the run directory {exp_dir} ({e.strerror or e}; " \
                    f"{free_space(exp_dir)}): set LOG_DIR (or expdir in the config) to a " \
                    "writable directory with free space"
    error = comm.broadcast_from_rank0(error)  # every rank stops with rank 0, none waits
    if error:
        comm.settle()  # the broadcast's last traces are gone before the ranks exit
        raise ConfigError(error)
    if world_rank == 0:
        log.info(describe_device(device))
        log.info(f"world size {world_size} ({env.launcher} launcher), "
                 f"global batch {params.global_batch_size}, local batch {params.local_batch_size}")
        params.log(log)
    return exp_dir
