"""What a training run is made of, built once: `build_training` returns a `Training` holding
the model, optimizer, schedule, loss scaler, loaders, checkpointer, profiler, run log and the
run guard. The train scripts and the benchmarks use the same objects and the same step
(training/step.py), so a benchmark times exactly what training runs. The loop itself lives
in train.py, where a reader follows it top to bottom.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

import networks
from data.checks import BatchScan
from data.loader import get_loader
from distributed import comm, fsdp
from distributed.layout import Layout
from evaluation.scores import T2M, Normaliser, validate
from networks.ensemble import Members
from networks.loss import build_loss
from training import compiling
from training.checkpoint import Checkpointer, load_weights, resolve_resume
from training.guard import RunGuard
from training.logs import RunLog, spread_line
from training.preemption import StopSignal
from training.profiling import StepProfiler
from training.progress import Progress
from training.setup import RunContext, peak_memory_gb
from utils.config_schema import Config
from utils.errors import DataError
from utils.model_wrappers import uncompiled

log = logging.getLogger("train")


# ----------------------------------------------------------------------------- the model

def build_wrapped_model(cfg: Config, layout: Layout) -> torch.nn.Module:
    """The config's network with the layout's layers, on the layout's device, wrapped for
    training (`wrap_model`)."""
    model = networks.build_model(cfg, layers=layout.layers).to(layout.device)
    n_local = sum(p.numel() for p in model.parameters())
    what = "on this rank" if layout.is_model_parallel else "in the model"
    log.info(f"Parameters {what}: {n_local / 1e6:.2f} M; memory after model set-up "
             f"(scaffolding high-water mark) {peak_memory_gb(layout.device):.2f} GB")
    return wrap_model(model, cfg, layout)


def wrap_model(model: torch.nn.Module, cfg: Config, layout: Layout) -> torch.nn.Module:
    """How the data-parallel ranks share the model, decided here once: sharded by FSDP2
    (`layout.fsdp`, distributed/fsdp.py), or replicated by DDP over the data-parallel
    group; then torch.compile (training/compiling.py). Both reduce gradients over dp only:
    the ranks of a model-parallel group hold different shards, whose gradients must not be
    mixed. On a GPU, DDP is built on a side stream: CUDA-graph capture of the full backward
    requires it (PyTorch CUDA semantics, "Usage with DistributedDataParallel") and it costs
    nothing otherwise. Under FSDP or activation checkpointing, torch.compile compiles each
    block before the model is wrapped (`compiling.by_block` says why)."""
    compiling.prepare(cfg)  # the compile cache, before DDP's constructor asks Inductor for it
    device = layout.device
    model = compiling.compile_blocks(model, cfg, layout.fsdp)  # before fully_shard / DDP
    what = compiling.describe(cfg, layout.fsdp)
    if what and comm.get_world_rank() == 0:
        log.info(what)
    if layout.fsdp:
        model = fsdp.shard_model(model, fsdp.mesh_of(comm.get_group("dp"), device),
                                 reshard_after_forward=not cfg.no_reshard_after_forward)
    elif comm.get_size("dp") > 1 and not cfg.noddp:
        side = torch.cuda.Stream() if device.type == "cuda" else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            # DDP all-reduces gradients bucket by bucket while backward is still running.
            model = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None,
                process_group=comm.get_group("dp"), bucket_cap_mb=cfg.bucket_cap_mb,
                gradient_as_bucket_view=cfg.disable_broadcast_buffers,
                **buffer_sync(not cfg.disable_broadcast_buffers))
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
    return compiling.compile_model(model, cfg, layout.fsdp)


def buffer_sync(each_forward: bool) -> dict[str, bool]:
    """DDP's argument for broadcasting buffers from rank 0 at every forward: named
    `forward_sync_buffers` since PyTorch 2.13 (`broadcast_buffers` warns there), and
    `broadcast_buffers` before (the oldest PyTorch this code supports is 2.7.1)."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": each_forward}
    return {"broadcast_buffers": each_forward}


# ----------------------------------------------------------------------------- optimizer

def build_optimizer(cfg: Config, model: torch.nn.Module,
                    capturable: bool = False) -> torch.optim.Optimizer:
    """Adam; `capturable` (CUDA graphs) keeps the step on the GPU and the LR in a tensor
    that the scheduler updates in place, so a replayed graph sees the current LR."""
    lr: float | torch.Tensor = cfg.lr
    if capturable:
        lr = torch.tensor(float(cfg.lr), device=next(model.parameters()).device)
    return torch.optim.Adam(model.parameters(), lr=lr, betas=tuple(cfg.betas),
                            fused=cfg.enable_fused or None, capturable=capturable)


def lr_factor(it: int, num_iters: int, warmup: int, schedule: str) -> float:
    """Linear warm-up over `warmup` iterations, then cosine decay to 0 at `num_iters`."""
    if warmup > 0 and it < warmup:
        return (it + 1) / warmup
    if schedule != "cosine":
        return 1.0
    progress = min(1.0, (it - warmup) / max(1, num_iters - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    n, w, s = cfg.num_iters, cfg.warmup, cfg.lr_schedule
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: lr_factor(it, n, w, s))


# ----------------------------------------------------------------------------- run state

@dataclass
class Training:
    """Everything a run holds; built by `build_training`."""

    cfg: Config
    ctx: RunContext
    layout: Layout
    model: torch.nn.Module
    loss: torch.nn.Module  # the config's loss (networks/loss.py), as the step calls it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
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
    steps_per_epoch: int
    members: Members | None = None  # an ensemble's members on this rank (None: deterministic)
    resumed: bool = False

    @property
    def device(self) -> torch.device:
        return self.layout.device

    @property
    def last_epoch(self) -> int:
        return math.ceil(self.cfg.num_iters / self.steps_per_epoch)

    def epochs(self) -> Iterator[int]:
        """Epoch numbers until `num_iters` steps are done. A run resumed inside an epoch
        first finishes that one (at least its end-of-epoch work, when the checkpoint came at
        its last step); the sampler skips the batches already done."""
        p = self.progress
        while p.iters < self.cfg.num_iters or p.epoch_step != 0:
            if p.epoch_step == 0:  # the previous epoch is complete: start the next one
                p.start_epoch()
            self.train_sampler.set_epoch(p.epoch, skip_batches=p.epoch_step)
            yield p.epoch
            p.epoch_step = 0  # this epoch is done, end-of-epoch work included

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The current epoch's remaining batches on this rank's device, stopping at
        `num_iters` steps."""
        if self.progress.iters >= self.cfg.num_iters:
            return
        for inp, tar in self.train_loader:
            with self.prof.range("data copy in"):
                inp = inp.to(self.device, non_blocking=True)
                tar = tar.to(self.device, non_blocking=True)
            yield inp, tar
            if self.progress.iters >= self.cfg.num_iters:
                return

    def end_of_epoch(self, train_time: float | None = None, steps: int = 0) -> None:
        """Validation, then the epoch's log lines and TensorBoard scalars; `train_time`
        None: the initial validation of the untrained model (step 0 of every curve)."""
        start = time.time()
        # Eagerly, without torch.compile: evaluation (no_grad, eval mode) would compile a
        # second graph of the model for little gain (docs/benchmarks.md, torch.compile).
        with self.layout.evaluating(self.model), compiling.eager():
            val = validate(uncompiled(self.model), uncompiled(self.loss), self.val_loader,
                           self.layout, self.ctx.precision, self.norm, members=self.members)
        val_time = time.time() - start
        p, t2m = self.progress, self.norm.channel(T2M)
        if train_time is None:
            self.log.scalars(0, {"Loss/train": val["loss"]})
            log.info(f"Initial val loss={val['loss']:.6f}, RMSE(u10m)="
                     f"{val['rmse_u10m']:.4f} m/s (persistence "
                     f"{val['persistence_rmse_u10m']:.4f} m/s); validation {val_time:.2f} s")
            if "spread_u10m" in val:
                log.info(spread_line(val))
        else:  # the epoch's mean loss, averaged over the data-parallel ranks for the log
            loss = p.loss_sum / max(p.step_count, 1)
            loss = comm.mean_over(loss.reshape(1), "dp").item()
            self.log.epoch(p.epoch, p.iters, max(train_time, 1e-9),
                           steps * self.ctx.global_batch_size, steps, loss,
                           self.scheduler.get_last_lr()[0], val, val_time)
        self.log.validation(p.iters, val, t2m)

    def finish(self) -> None:
        """The final checkpoint and the run's last log line."""
        self.ckpt.save(self.progress)
        log.info(f"Finished {self.progress.iters} iterations; peak memory "
                 f"{peak_memory_gb(self.device):.2f} GB")
        self.log.close()


def build_training(cfg: Config, ctx: RunContext, layout: Layout, model: torch.nn.Module,
                   capturable: bool = False) -> Training:
    """Loaders, optimizer, schedule, loss scaling, checkpoints (resumed if asked), profiler
    and logs for `model` (built by `build_wrapped_model`). The loaders read this rank's data shard
    (dp) and, on a spatial mesh, only the layout's tile of every field."""
    # SIGUSR1/SIGTERM from here on: a checkpoint at the next step (training/preemption.py).
    # Installed before the data loaders fork their workers, which inherit the handler.
    stop = StopSignal()
    # Every data-parallel rank reads its own shard of each epoch (the ranks of a model-
    # parallel group the same one: on a spatial mesh, each its tile of the same samples).
    shard = {"batch_size": ctx.local_batch_size, "num_replicas": comm.get_size("dp"),
             "rank": comm.get_rank("dp"), "tile": layout.tile}
    train_loader, _, train_sampler = get_loader(cfg, cfg.train_data_path, train=True, **shard)
    if len(train_loader) == 0:
        raise DataError(f"{cfg.train_data_path}: fewer training samples per data-parallel "
                        f"rank than the local batch size {ctx.local_batch_size}")
    val_loader, _, _ = get_loader(cfg, cfg.valid_data_path, train=False, **shard)
    norm = Normaliser(cfg, layout.device)
    # The config's loss, of this rank's rows, as the layout completes it; training and
    # validation (in eval mode: `crps` is then the fair CRPS) call this one object.
    loss = run_loss(cfg, layout, norm.weights[0, layout.tile.rows])
    loss = compiling.compile_loss(loss, cfg, local=layout.sum_over_grid is None
                                  and layout.gather_members is None)
    members = layout.members(cfg)  # an ensemble's members on this rank, and their noise
    if members is not None:
        log.info(describe_members(members, layout))
    optimizer = build_optimizer(cfg, model, capturable=capturable)
    scheduler = build_scheduler(cfg, optimizer)
    scaler = layout.grad_scaler(ctx.precision)  # fp16: one overflow verdict per model replica
    ckpt = Checkpointer(ctx.run_dir, cfg, model, optimizer, scheduler, scaler, layout)
    ckpt.check_room()  # a disk too full for the checkpoints stops the run now
    progress = Progress(loss_sum=torch.zeros((), device=layout.device))
    resume = resolve_resume(cfg.resume, ctx.run_dir, requeue=cfg.requeue)
    if resume:  # a resumed fine-tune continues from its own checkpoint, not init_from's
        progress = ckpt.restore(resume)
    elif cfg.init_from:
        load_weights(cfg.init_from, cfg, model, layout)
    ckpt.start_at(progress.iters)  # set aside checkpoints of an earlier run beyond this point
    # purge_step: a resumed run first drops the TensorBoard events that the interrupted run
    # wrote after its checkpoint, so that every curve is one line without repeated steps.
    # Events at step `iters` itself are kept, unless that step's end-of-epoch work is still
    # to do (epoch_step != 0): then this run writes them again.
    purge = (progress.iters + (0 if progress.epoch_step else 1)) if resume else None
    return Training(
        cfg=cfg, ctx=ctx, layout=layout, model=model, loss=loss, optimizer=optimizer,
        scheduler=scheduler, scaler=scaler, train_loader=train_loader,
        train_sampler=train_sampler, val_loader=val_loader, norm=norm, ckpt=ckpt,
        prof=StepProfiler(layout.device, ctx.run_dir, rank=comm.get_world_rank()),
        log=RunLog(ctx.run_dir, enabled=comm.get_world_rank() == 0, purge_step=purge),
        guard=RunGuard(cfg, layout.device, ckpt, stop,
                       scan=BatchScan(train_loader.dataset, train_sampler)),
        progress=progress, steps_per_epoch=len(train_loader), members=members,
        resumed=bool(resume))


def run_loss(cfg: Config, layout: Layout, row_weights: torch.Tensor) -> torch.nn.Module:
    """The config's loss (networks/loss.py) of fields whose rows have `row_weights`, as the
    layout completes it: its sums over the mesh's tiles, an ensemble's members gathered
    over the ens ranks."""
    return build_loss(cfg.loss, row_weights, layout.sum_over_grid, crps_alpha=cfg.crps_alpha,
                      gather_members=layout.gather_members)


def describe_members(members: Members, layout: Layout) -> str:
    """The run's log line on its ensemble: size, what each rank holds, the noise."""
    split = (f"members {members.first}-{members.first + members.count - 1} on this rank, "
             f"the others on its {comm.get_size('ens') - 1} ens peer(s)"
             if members.is_split else "all on this rank")
    return (f"Ensemble: {members.size} members per initial condition ({split}), each "
            f"conditioned on {members.noise_channels} N(0, 1) noise channels per token")
