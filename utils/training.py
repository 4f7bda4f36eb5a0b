"""What a training run is made of, built once: `build_training` returns a `Training` holding
the model, optimizer, schedule, loss scaler, loaders, checkpointer, profiler, run log and the
run guard; `train_step` is one optimizer step on it. The train scripts and the benchmarks use
the same two, so a benchmark times exactly what training runs. The loop itself lives in
train.py, where a reader follows it top to bottom.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from utils import comm
from utils.data.checks import BatchScan
from utils.data.loader import get_loader
from utils.errors import ConfigError, DataError
from utils.evaluation import Normaliser, l2_loss
from utils.precision import autocast, grad_scaler, settle_amp_mode
from utils.rollout import rollout
from utils.run.checkpoint import Checkpointer, resolve_resume
from utils.run.compile_cost import use_compile_cache
from utils.run.finetune import load_weights
from utils.run.guard import RunGuard
from utils.run.preemption import StopSignal
from utils.run.profiling import StepProfiler
from utils.run.progress import Progress
from utils.run.run_log import RunLog
from utils.run.setup import experiment_dir
from utils.tile import Tile

# ----------------------------------------------------------------------------- optimizer

def build_optimizer(params: Any, model: torch.nn.Module,
                    capturable: bool = False) -> torch.optim.Optimizer:
    """Adam; `capturable` (CUDA graphs) keeps the step on the GPU and the LR in a tensor
    that the scheduler updates in place, so a replayed graph sees the current LR."""
    if params.optimizer != "Adam":
        raise ConfigError(f"optimizer '{params.optimizer}' is not supported (use Adam)")
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


def wrap_model(model: torch.nn.Module, params: Any, device: torch.device) -> torch.nn.Module:
    """DDP over the data-parallel group (every rank for train.py; train_mp.py's dp group),
    then torch.compile. On a GPU, DDP is built on a side stream: CUDA-graph capture of the
    full backward requires it (PyTorch CUDA semantics, "Usage with DistributedDataParallel")
    and it costs nothing otherwise."""
    if params.enable_jit:  # before DDP, whose constructor already asks Inductor for its cache
        use_compile_cache(params.expdir)  # compiled once per config, not once per job
    if comm.get_size("dp") > 1 and not params.noddp:
        side = torch.cuda.Stream() if device.type == "cuda" else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            # DDP all-reduces gradients bucket by bucket while backward is still running.
            model = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None,
                process_group=comm.get_group("dp"), bucket_cap_mb=params.bucket_cap_mb,
                gradient_as_bucket_view=params.disable_broadcast_buffers,
                **buffer_sync(not params.disable_broadcast_buffers))
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
    if params.enable_jit:
        model = torch.compile(model)
    return model


def buffer_sync(each_forward: bool) -> dict[str, bool]:
    """DDP's argument for broadcasting buffers from rank 0 at every forward: named
    `forward_sync_buffers` since PyTorch 2.13 (`broadcast_buffers` warns there), and
    `broadcast_buffers` before (the oldest PyTorch this code supports is 2.7.1)."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": each_forward}
    return {"broadcast_buffers": each_forward}


# ----------------------------------------------------------------------------- run state

@dataclass
class Training:
    """Everything a run holds; built by `build_training`."""

    params: Any
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    train_loader: Any
    train_sampler: Any
    val_loader: Any
    norm: Normaliser
    ckpt: Checkpointer
    prof: StepProfiler
    log: RunLog
    guard: RunGuard
    progress: Progress
    exp_dir: str
    steps_per_epoch: int
    resumed: bool = False
    tile: Tile | None = None  # spatial parallelism: this rank's part of the grid
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = l2_loss

    @property
    def last_epoch(self) -> int:
        return math.ceil(self.params.num_iters / self.steps_per_epoch)

    def epochs(self) -> Iterator[int]:
        """Epoch numbers until `num_iters` steps are done. A run resumed inside an epoch
        first finishes that one (at least its end-of-epoch work, when the checkpoint came at
        its last step); the sampler skips the batches already done."""
        p = self.progress
        while p.iters < self.params.num_iters or p.epoch_step != 0:
            if p.epoch_step == 0:  # the previous epoch is complete: start the next one
                p.start_epoch()
            self.train_sampler.set_epoch(p.epoch, skip_batches=p.epoch_step)
            yield p.epoch
            p.epoch_step = 0  # this epoch is done, end-of-epoch work included

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The current epoch's remaining batches, stopping at `num_iters` steps."""
        if self.progress.iters >= self.params.num_iters:
            return
        for batch in self.train_loader:
            yield batch
            if self.progress.iters >= self.params.num_iters:
                return

    def close(self) -> None:
        self.log.close()


def build_training(params: Any, device: torch.device, model: torch.nn.Module,
                   checkpoint_hooks: dict[str, Callable] | None = None,
                   capturable: bool = False, tile: Tile | None = None) -> Training:
    """Loaders, optimizer, schedule, loss scaling, checkpoints (resumed if asked), profiler
    and logs for `model` (already on `device`, wrapped by `wrap_model`). With a `tile`
    (spatial parallelism) the loaders read only that part of every field."""
    exp_dir = experiment_dir(params, comm.get_world_size(), device)
    settle_amp_mode(params, device)  # 'auto' -> this hardware's choice; emulated? say so
    # SIGUSR1/SIGTERM from here on: a checkpoint at the next step (utils/run/preemption.py).
    # Installed before the data loaders fork their workers, which inherit the handler.
    stop = StopSignal()
    # Every data-parallel rank reads its own shard of each epoch (the ranks of a model-
    # parallel group the same one: on a spatial mesh, each its tile of the same samples).
    shard = {"num_replicas": comm.get_size("dp"), "rank": comm.get_rank("dp"), "tile": tile}
    train_loader, _, train_sampler = get_loader(params, params.train_data_path, train=True,
                                                **shard)
    if len(train_loader) == 0:
        raise DataError(f"{params.train_data_path}: fewer training samples per data-parallel "
                        f"rank than the local batch size {params.local_batch_size}")
    val_loader, _, _ = get_loader(params, params.valid_data_path, train=False, **shard)
    optimizer = build_optimizer(params, model, capturable=capturable)
    scheduler = build_scheduler(params, optimizer)
    scaler = grad_scaler(params, device)
    ckpt = Checkpointer(exp_dir, params, model, optimizer, scheduler, scaler,
                        **(checkpoint_hooks or {}))
    ckpt.check_room()  # a disk too full for the checkpoints stops the run now
    progress = Progress(loss_sum=torch.zeros((), device=device))
    resume = resolve_resume(params.resume, exp_dir, requeue=params.requeue)
    if resume:  # a resumed fine-tune continues from its own checkpoint, not init_from's
        progress = ckpt.restore(resume)
    elif params.get("init_from"):
        load_weights(params.init_from, params, model, ckpt.to_local)
    ckpt.start_at(progress.iters)  # set aside checkpoints of an earlier run beyond this point
    # purge_step: a resumed run first drops the TensorBoard events that the interrupted run
    # wrote after its checkpoint, so that every curve is one line without repeated steps.
    # Events at step `iters` itself are kept, unless that step's end-of-epoch work is still
    # to do (epoch_step != 0): then this run writes them again.
    purge = (progress.iters + (0 if progress.epoch_step else 1)) if resume else None
    return Training(
        params=params, device=device, model=model, optimizer=optimizer, scheduler=scheduler,
        scaler=scaler, train_loader=train_loader, train_sampler=train_sampler,
        val_loader=val_loader, norm=Normaliser(params, device), ckpt=ckpt,
        prof=StepProfiler(device, exp_dir, rank=comm.get_world_rank()),
        log=RunLog(exp_dir, enabled=comm.get_world_rank() == 0, purge_step=purge),
        guard=RunGuard(params, device, ckpt, stop,
                       scan=BatchScan(train_loader.dataset, train_sampler)),
        progress=progress, exp_dir=exp_dir,
        steps_per_epoch=len(train_loader), resumed=bool(resume), tile=tile,
        loss_fn=loss_function(params))


def loss_function(params: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The training loss; with enable_jit compiled too, so that its subtraction, squares and
    norms over the whole output are one pass (cpu_short_opt's step: ~9 % faster, for ~2 s
    more of a cold compile and ~0.1 s of a warm one; README step 6)."""
    return torch.compile(l2_loss) if params.enable_jit else l2_loss


# ----------------------------------------------------------------------------- the step

def rollout_loss(model: torch.nn.Module, inp: torch.Tensor, tar: torch.Tensor,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Mean over k of loss_fn(x_k, target_k), x_k the model applied k times to `inp`
    (B, C, H, W); `tar` is (B, K, C, H, W). Gradients flow through every step, so the
    model learns from the errors its own output feeds into the next step."""
    preds = rollout(model, inp, tar.shape[1])
    losses = [loss_fn(preds[:, k], tar[:, k]) for k in range(tar.shape[1])]
    return torch.stack(losses).mean()


def train_step(run: Training, inp: torch.Tensor, tar: torch.Tensor,
               after_backward: Callable[[torch.nn.Module], None] | None = None,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
               ) -> torch.Tensor:
    """One optimizer step: forward under autocast, scaled backward, optimizer step.
    `after_backward(model)` runs between backward and the update (train_mp.py: the
    model-parallel gradient reduction); `loss_fn` is the loss (train_mp.py on a spatial
    mesh: the loss of tiles, summed over the mesh; default: the run's, `l2_loss`). A target
    with a step axis (B, K, C, H, W) (`rollout_steps` K > 1) trains on the mean loss of a
    K-step rollout."""
    prof, loss_fn = run.prof, loss_fn or getattr(run, "loss_fn", l2_loss)
    with prof.range("forward"):
        with autocast(run.params, run.device):
            if tar.dim() == inp.dim():
                loss = loss_fn(run.model(inp), tar)
            else:
                loss = rollout_loss(run.model, inp, tar, loss_fn)
    with prof.range("backward"):
        run.scaler.scale(loss).backward()
    if after_backward is not None:
        with prof.range("model-parallel gradient reduction"):
            after_backward(run.model)
    with prof.range("optimizer"):
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
    return loss.detach()
