"""Plumbing shared by train.py, train_mp.py and train_mp_graphs.py: process set-up,
optimizer and schedule, mixed precision, validation, memory and run directories.
The training loop itself stays in the scripts, where a reader can follow it."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from utils import comm
from utils.data_loader import DataError, load_stats
from utils.launch_env import LaunchEnv, resolve_launch_env
from utils.loss import l2_loss
from utils.metrics import weighted_acc_channels, weighted_rmse_channels
from utils.YParams import ConfigError

log = logging.getLogger(__name__)


def init_process(tp: int = 1, cp: int = 1, order: str = "tp-cp-dp") -> tuple[LaunchEnv,
                                                                           torch.device]:
    """Join the job (torchrun, SLURM or mpirun), pick the device, build the process groups."""
    env = resolve_launch_env()
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        # TF32 matmuls unless the user turned them off the NVIDIA way.
        tf32 = os.environ.get("NVIDIA_TF32_OVERRIDE", "1") != "0"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cpu_threads(env))
    if env.distributed:
        # A bounded timeout: a dead rank ends the job instead of hanging it for 30 minutes.
        timeout = timedelta(seconds=float(os.environ.get("DIST_TIMEOUT_SEC", "300")))
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank, world_size=env.world_size, timeout=timeout,
            device_id=device if device.type == "cuda" else None)
    if env.world_size % (tp * cp):  # every rank finds this: all exit with the same line
        raise ConfigError(f"world size {env.world_size} is not divisible by tp x cp = "
                          f"{tp} x {cp}: launch a multiple of {tp * cp} processes, or change "
                          "--tp / --cp")
    comm.init(tp=tp, cp=cp, order=order)
    return env, device


def cpu_threads(env: LaunchEnv, environ: Any = None) -> int:
    """Intra-op threads for a CPU process: OMP_NUM_THREADS if set, else the CPUs SLURM gave
    the task, else the cores shared evenly by the processes on this node (several ranks
    with all cores each would oversubscribe the machine)."""
    environ = os.environ if environ is None else environ
    for key in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
        if environ.get(key, "").isdigit() and int(environ[key]) > 0:
            return int(environ[key])
    per_node = environ.get("LOCAL_WORLD_SIZE") or environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if per_node is None and env.distributed:
        per_node = str(env.world_size)  # unknown layout: assume one node
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, int(per_node or 1)))


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"Using GPU {torch.cuda.get_device_name(device)} (cuda:{device.index})"
    return f"CUDA not available: training on CPU with {torch.get_num_threads()} threads"


def experiment_dir(params: Any, world_size: int, device: torch.device) -> str:
    """<expdir>/<config>/<N><GPU|CPU>/<run_num>/, as in the tutorial."""
    kind = "GPU" if device.type == "cuda" else "CPU"
    path = os.path.join(params.expdir, params.config, f"{world_size}{kind}", str(params.run_num))
    return path


def build_optimizer(params: Any, model: torch.nn.Module,
                    capturable: bool = False) -> torch.optim.Optimizer:
    """Adam; `capturable` (CUDA graphs) keeps the step on the GPU and the LR in a tensor
    that the scheduler updates in place, so a replayed graph sees the current LR."""
    if params.optimizer != "Adam":
        raise ValueError(f"optimizer '{params.optimizer}' is not supported (use Adam)")
    lr = params.lr
    if capturable:
        lr = torch.tensor(float(params.lr), device=next(model.parameters()).device)
    return torch.optim.Adam(model.parameters(), lr=lr, betas=tuple(params.betas),
                            fused=bool(params.enable_fused) or None, capturable=capturable)


def lr_factor(it: int, num_iters: int, warmup: int, schedule: str) -> float:
    """Linear warm-up over `warmup` iterations, then cosine decay to 0 at `num_iters`."""
    if warmup > 0 and it < warmup:
        return (it + 1) / warmup
    if schedule != "cosine":
        return 1.0
    progress = min(1.0, (it - warmup) / max(1, num_iters - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(params: Any, optimizer: torch.optim.Optimizer):
    n, w, s = int(params.num_iters), int(params.warmup or 0), params.lr_schedule
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: lr_factor(it, n, w, s))


def autocast_dtype(amp_mode: str) -> torch.dtype | None:
    return {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[amp_mode]


def autocast(params: Any, device: torch.device):
    dtype = autocast_dtype(params.amp_mode)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(params: Any, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling keeps fp16 gradients from underflowing; bf16 and fp32 don't need it."""
    return torch.amp.GradScaler(device.type, enabled=params.amp_mode == "fp16")


def peak_memory_gb(device: torch.device) -> float:
    """CUDA: max allocated by tensors. CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB -> GiB


class Normaliser:
    """Per-channel global statistics, to report errors in physical units."""

    def __init__(self, params: Any, device: torch.device):
        C = int(params.n_out_channels)
        H, W = params.img_size
        # load_stats: a missing file or a wrong shape is a one-line DataError.
        self.means = torch.from_numpy(
            load_stats(params.global_means_path, C, "global means")).to(device)
        self.stds = torch.from_numpy(
            load_stats(params.global_stds_path, C, "global stds")).to(device)
        clim = load_stats(params.time_means_path, C, "time means")
        if clim.shape[2] < H or clim.shape[3] < W:
            raise DataError(f"time means {params.time_means_path} are {clim.shape[2]}x"
                            f"{clim.shape[3]}, smaller than img_size {H}x{W}")
        clim = torch.from_numpy(clim[:, :, :H, :W]).to(device)
        self.climatology = (clim - self.means) / self.stds  # normalised, for ACC


def settle() -> None:
    """A barrier before the ranks leave together (a finished or preempted run, an error every
    rank raises): no rank shuts its connections down (`comm.shutdown`) while a peer is still
    in a collective with it."""
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: torch.Tensor, group: Any = None) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(values, group=group)
    return values


@torch.no_grad()
def validate(model: torch.nn.Module, loader: Any, device: torch.device, params: Any,
             norm: Normaliser, group: Any = None, max_batches: int | None = None
             ) -> dict[str, float]:
    """Loss, latitude-weighted RMSE(u10m) in m/s, persistence RMSE and ACC over the
    validation set, summed over data-parallel ranks (`group`) and averaged."""
    model.eval()
    # [loss, rmse_u10, persistence_u10, acc_u10, acc_t2m, samples]
    acc = torch.zeros(6, dtype=torch.float64, device=device)
    first = None
    for i, (inp, tar) in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        inp, tar = inp.to(device, non_blocking=True), tar.to(device, non_blocking=True)
        with autocast(params, device):
            gen = model(inp)
        gen = gen.float()
        b = inp.shape[0]
        rmse = weighted_rmse_channels(gen, tar) * norm.stds[0, :, 0, 0]
        persist = weighted_rmse_channels(inp, tar) * norm.stds[0, :, 0, 0]
        skill = weighted_acc_channels(gen, tar, norm.climatology)
        acc += torch.stack([l2_loss(gen, tar).double() * b, rmse[:, 0].double().sum(),
                            persist[:, 0].double().sum(), skill[:, 0].double().sum(),
                            skill[:, 2].double().sum(),
                            torch.tensor(float(b), dtype=torch.float64, device=device)])
        if first is None:
            first = (inp[0, 2].cpu().numpy(), tar[0, 2].cpu().numpy(), gen[0, 2].cpu().numpy())
    all_reduce_sum(acc, group)
    n = max(acc[5].item(), 1.0)
    model.train()
    return {"loss": acc[0].item() / n, "rmse_u10m": acc[1].item() / n,
            "persistence_rmse_u10m": acc[2].item() / n, "acc_u10m": acc[3].item() / n,
            "acc_t2m": acc[4].item() / n, "samples": n, "example_t2m": first}


class NonFiniteLoss:
    """Remembers the first iteration whose training loss was NaN or inf.

    `record` runs on the device and never waits for it (no host sync: a GPU keeps running
    ahead of Python). `check` reads the result (a sync; an all-reduce when distributed, so
    every rank stops at the same step) and raises FloatingPointError. train() checks every
    step on CPU, where reading a value costs nothing, every `GPU_CHECK_EVERY` steps on a GPU,
    and always at the end of an epoch and before writing a checkpoint: no NaN reaches a
    checkpoint. With fp16 the GradScaler already skips steps whose *gradients* overflow;
    a loss that is NaN/inf in the forward pass itself is a real failure and stops the run.
    """

    GPU_CHECK_EVERY = 50

    def __init__(self, device: torch.device):
        self.device = device
        self.first = torch.full((), -1, dtype=torch.int64, device=device)  # -1: none yet

    def record(self, loss: torch.Tensor, iteration: int) -> None:
        self.first.masked_fill_((self.first < 0) & ~torch.isfinite(loss.detach()), iteration)

    def due(self, iteration: int) -> bool:
        return self.device.type != "cuda" or iteration % self.GPU_CHECK_EVERY == 0

    def check(self, last_checkpoint: str | None = None) -> None:
        never = torch.iinfo(torch.int64).max
        first = torch.where(self.first < 0, never, self.first)
        if dist.is_initialized():
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        iteration = int(first.item())
        if iteration != never:
            settle()  # every rank raises now and exits
            raise FloatingPointError(
                f"training loss is NaN/inf at iteration {iteration}: stopped without saving; "
                f"the last checkpoint, {last_checkpoint or '(none yet)'}, is kept "
                "(lower the lr, or use bf16 instead of fp16)")


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
