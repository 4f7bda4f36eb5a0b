"""A run's start, written once for the train scripts, inference and the benchmarks: logging
on rank 0, seeds, and the values the config leaves to run time, resolved once into a
`RunContext` (the config itself stays as it was checked)."""

from __future__ import annotations

import logging
import os
import random
import resource
from dataclasses import dataclass

import numpy as np
import torch

from distributed import comm
from distributed.layout import Layout
from training.disk import free_space
from training.logs import config_logger, log_to_file
from training.run_dirs import choose_run, compose, create_run, run_label
from utils.allocator import keep_freed_memory
from utils.config_schema import Config
from utils.errors import ConfigError
from utils.hardware import cpu_class
from utils.openmp import describe as describe_wait_policy
from utils.precision import Precision, choose_precision

log = logging.getLogger("train")


@dataclass(frozen=True)
class RunContext:
    """What a run resolved at start-up, once: its precision (`amp_mode: auto` decided for
    this hardware), batch sizes (global = local x dp), and its directory."""

    precision: Precision
    local_batch_size: int
    global_batch_size: int
    run_dir: str  # <expdir>/<config>/<N><CPU|GPU>/<run name>
    why: str  # why this directory: a new run, or the run it continues


def batch_sizes(cfg: Config, dp_size: int) -> tuple[int, int]:
    """(local, global): global = local x dp. A given local_batch_size defines the global."""
    if cfg.local_batch_size is not None:
        return cfg.local_batch_size, cfg.local_batch_size * dp_size
    if cfg.global_batch_size % dp_size:
        raise ConfigError(f"global_batch_size {cfg.global_batch_size} is not divisible by "
                          f"the data-parallel size {dp_size}")
    return cfg.global_batch_size // dp_size, cfg.global_batch_size


def runs_parent(cfg: Config, world_size: int, device: torch.device) -> str:
    """<expdir>/<config>/<N><GPU|CPU>, where the runs of this config and world size live."""
    kind = "GPU" if device.type == "cuda" else "CPU"
    return os.path.join(cfg.expdir, cfg.config, f"{world_size}{kind}")


def choose_run_dir(cfg: Config, device: torch.device, log_file: bool = True
                   ) -> tuple[str, str]:
    """(run directory, why) of this run, chosen on rank 0 (training/run_dirs.py), which
    creates a new one (and with `log_file`, starts its out.log); every rank gets the same
    answer."""
    parent = runs_parent(cfg, comm.get_world_size(), device)
    answer: tuple[str, str] | None = None
    error = None
    if comm.get_world_rank() == 0:
        label, target = run_label(cfg.flags), parent
        try:
            choice = choose_run(parent, label, run_num=cfg.run_num, resume=cfg.resume,
                                environ=os.environ)
            name = compose(choice.name, label) if choice.new else choice.name
            target = os.path.join(parent, name)
            if choice.new:
                name = create_run(parent, choice.name, label)
            target = os.path.join(parent, name)
            os.makedirs(target, exist_ok=True)
            if log_file:
                log_to_file(os.path.join(target, "out.log"))
            answer = (target, choice.why if cfg.run_num is None else "run_num given")
        except OSError as e:
            error = _unwritable(target, parent, e)
    answer, error = comm.broadcast_from_rank0((answer, error))
    if error:  # every rank raises rank 0's error, after a last barrier
        comm.settle()  # the broadcast's last traces are gone before the ranks exit
        raise ConfigError(error)
    return answer


def _unwritable(path: str, near: str, e: OSError) -> str:
    return (f"cannot write the run directory {path} ({e.strerror or e}; {free_space(near)}): "
            "set LOG_DIR (or expdir in the config) to a writable directory with free space")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"Using GPU {torch.cuda.get_device_name(device)} (cuda:{device.index})"
    return (f"CUDA not available: training on CPU with {torch.get_num_threads()} threads; "
            f"{cpu_class().describe()}")


# The process's peak before the last `reset_peak_memory`, by device: `peak_memory_gb` stays
# the whole run's peak however often a step's own peak is measured.
_peak_before_reset: dict[str, float] = {}


def _peak_since_reset_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB -> GiB


def peak_memory_gb(device: torch.device) -> float:
    """The whole process's peak. CUDA: max allocated by tensors. CPU: the process's peak
    resident set size."""
    return max(_peak_since_reset_gb(device), _peak_before_reset.get(str(device), 0.0))


def reset_peak_memory(device: torch.device) -> bool:
    """Start measuring a new peak (`memory_since_reset`): on a GPU the caching allocator's
    peak statistics, on a CPU the resident set's high-water mark (Linux: /proc/self/
    clear_refs). False where the CPU's cannot be reset: it then counts from the start."""
    key = str(device)
    _peak_before_reset[key] = peak_memory_gb(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size (proc(5))
        return True
    except OSError:
        return False


def memory_since_reset(device: torch.device) -> dict[str, float]:
    """The peaks since `reset_peak_memory`, GiB: on a GPU the tensors' (max allocated) and
    the caching allocator's (max reserved); on a CPU the resident set's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return {"tensors": torch.cuda.max_memory_allocated(device) / 1024**3,
                "reserved": torch.cuda.max_memory_reserved(device) / 1024**3}
    return {"resident set": _peak_since_reset_gb(device)}


def log_config(cfg: Config) -> None:
    log.info("------------------ Configuration ------------------")
    for key, value in sorted(cfg.model_dump().items()):
        log.info(f"{key}: {value}")
    log.info("---------------------------------------------------")


def log_header(cfg: Config, layout: Layout, run_dir: str, why: str, local: int,
               global_: int) -> None:
    """The run's first lines: where it writes, on what, how it is split, its config."""
    log.info(f"Run directory {run_dir} ({why})")
    log.info(describe_device(layout.device))
    if layout.device.type == "cpu":
        log.info(describe_wait_policy())  # chosen before torch loaded (utils/openmp.py)
    log.info(f"world size {comm.get_world_size()} ({layout.env.launcher} launcher), "
             f"global batch {global_}, local batch {local}")
    log_config(cfg)
    log.info(layout.describe())


def start_run(cfg: Config, layout: Layout, announce: bool = True) -> RunContext:
    """The allocator setting (utils/allocator.py), seeds, batch sizes, the run directory and
    the precision: the run's context. `announce`: set up the log (rank 0: stdout and
    out.log) and write the run's header to it; a benchmark, which prints its own report,
    passes False."""
    keep_freed_memory()  # no page faults on every step's fresh activations
    local, global_ = batch_sizes(cfg, comm.get_size("dp"))
    seed_everything(cfg.seed)
    if announce:
        config_logger(comm.get_world_rank())
    run_dir, why = choose_run_dir(cfg, layout.device, log_file=announce)
    if announce:
        log_header(cfg, layout, run_dir, why, local, global_)
    precision = choose_precision(cfg.amp_mode, layout.device, config=cfg.config)
    return RunContext(precision, local, global_, run_dir, why)
