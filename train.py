"""Train the ViT weather forecaster on one device, or data-parallel with DDP.

    python train.py --config=cpu_short                          # one process (CPU or GPU)
    torchrun --nproc_per_node 2 train.py --config=cpu_bs32_opt  # data parallel
    sbatch -N 4 submit_pm_dp.sh --config=bs256_opt               # on a SLURM cluster

Input: all 20 ERA5 fields at time t. Target: the same fields 6 hours later.
train_mp.py reuses `train()` below and changes only the model and the step.
"""

import logging
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from networks.vit import vit_from_params
from utils import comm
from utils.checkpoint import Checkpointer, latest_checkpoint
from utils.cli import build_parser, load_params, set_batch_sizes
from utils.data_loader import get_data_loader
from utils.errors import exit_on_user_error
from utils.logging_utils import config_logger, log_to_file
from utils.loss import l2_loss
from utils.preemption import EXIT_PREEMPTED, StopSignal, requeue_slurm_job
from utils.profiling import StepProfiler
from utils.run_log import RunLog
from utils.training import (Normaliser, autocast, build_optimizer, build_scheduler,
                            describe_device, experiment_dir, grad_scaler, init_process,
                            peak_memory_gb, seed_everything, validate)

log = logging.getLogger("train")


def build_model(params, args, device):
    model = vit_from_params(params).to(device)
    if dist.is_initialized() and not args.noddp:
        # DDP all-reduces gradients bucket by bucket while backward is still running.
        model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=args.bucket_cap_mb,
            broadcast_buffers=not args.disable_broadcast_buffers,
            gradient_as_bucket_view=args.disable_broadcast_buffers)
    if params.enable_jit:
        model = torch.compile(model)
    return model


def train_step(model, optimizer, scaler, inp, tar, params, device, prof):
    """One optimizer step: forward under autocast, scaled backward, optimizer step."""
    with prof.range("forward"):
        with autocast(params, device):
            gen = model(inp)
            loss = l2_loss(gen, tar)
    with prof.range("backward"):
        scaler.scale(loss).backward()
    with prof.range("optimizer"):
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def train(params, args, device, model, step_fn=train_step, checkpoint_hooks=None,
          optimizer_kwargs=None):
    """The training loop. `step_fn` and the checkpoint layout hooks are what the
    model-parallel and CUDA-graph scripts swap in."""
    world_rank = comm.get_world_rank()
    exp_dir = experiment_dir(params, comm.get_world_size(), device)

    # ---- data: every data-parallel rank reads its own shard of each epoch
    distributed = dist.is_initialized()
    if params.data_loader_config == "dali":
        from utils.data_loader_dali import get_data_loader_dali as get_loader
    else:
        get_loader = get_data_loader
    shard = {"num_replicas": comm.get_size("dp"), "rank": comm.get_rank("dp")}
    train_loader, _, train_sampler = get_loader(params, params.train_data_path, distributed,
                                                train=True, **shard)
    val_loader, _, _ = get_loader(params, params.valid_data_path, distributed, train=False,
                                  **shard)
    norm = Normaliser(params, device)

    # ---- optimizer, schedule, loss scaling, checkpoints
    optimizer = build_optimizer(params, model, **(optimizer_kwargs or {}))
    scheduler = build_scheduler(params, optimizer)
    scaler = grad_scaler(params, device)
    ckpt = Checkpointer(exp_dir, params, model, optimizer, scheduler, scaler,
                        **(checkpoint_hooks or {}))
    iters, epoch, epoch_step = 0, 0, 0
    resume = args.resume if args.resume != "auto" else latest_checkpoint(exp_dir)
    if resume:
        iters, epoch, epoch_step = ckpt.restore(resume).values()
    stop = StopSignal()
    prof = StepProfiler(device, exp_dir, rank=world_rank)
    run = RunLog(exp_dir, enabled=world_rank == 0, purge_step=iters + 1 if resume else None)
    t2m = (norm.means[0, 2].item(), norm.stds[0, 2].item())

    # ---- step 0: initial losses, so every curve starts from the untrained model
    if iters == 0:
        val = validate(model, val_loader, device, params, norm, comm.get_group("dp"))
        run.scalars(0, {"Loss/train": val["loss"]})
        run.validation(0, val, t2m)
        log.info(f"Initial val loss={val['loss']:.6f}, RMSE(u10m)={val['rmse_u10m']:.4f} m/s "
                 f"(persistence {val['persistence_rmse_u10m']:.4f} m/s)")

    # ---- training loop: num_iters optimizer steps, in epochs over the training data
    steps_per_epoch = len(train_loader)
    last_epoch = math.ceil(params.num_iters / steps_per_epoch)
    interval = int(params.checkpoint_interval or 0)
    log.info(f"Starting training loop: {params.num_iters} iterations, "
             f"{steps_per_epoch} per epoch")
    while iters < params.num_iters:
        if epoch_step == 0 or epoch_step >= steps_per_epoch:
            epoch, epoch_step = epoch + 1, 0
        train_sampler.set_epoch(epoch, skip_batches=epoch_step)
        model.train()
        prof.epoch_start(epoch, last_epoch)
        start, step_count = time.time(), 0
        loss_sum = torch.zeros((), device=device)
        for inp, tar in train_loader:
            with prof.range(f"step {iters}"):
                with prof.range("data copy in"):
                    inp = inp.to(device, non_blocking=True)
                    tar = tar.to(device, non_blocking=True)
                loss = step_fn(model, optimizer, scaler, inp, tar, params, device, prof)
            scheduler.step()
            loss_sum += loss
            iters, epoch_step, step_count = iters + 1, epoch_step + 1, step_count + 1
            if iters == 1:
                log.info(f"Memory after the first step {peak_memory_gb(device):.2f} GB")
            if interval and iters % interval == 0:
                ckpt.save(iters, epoch, epoch_step)
            if stop.should_stop(device):
                ckpt.save(iters, epoch, epoch_step)
                log.info(f"Signal {stop.received} received: stopped at iteration {iters}")
                if args.requeue and world_rank == 0:
                    requeue_slurm_job()
                sys.exit(EXIT_PREEMPTED)
            if iters >= params.num_iters:
                break
        prof.epoch_end()
        train_time = time.time() - start
        train_loss = loss_sum / max(step_count, 1)
        if distributed:  # average over data-parallel ranks for the log
            dist.all_reduce(train_loss, group=comm.get_group("dp"))
            train_loss /= comm.get_size("dp")
        train_loss = train_loss.item()
        if not math.isfinite(train_loss):
            raise FloatingPointError(f"training loss is {train_loss} in epoch {epoch}: stopped; "
                                     "the last checkpoint is kept (try a lower lr or bf16)")

        val_start = time.time()
        val = validate(model, val_loader, device, params, norm, comm.get_group("dp"))
        val_time = time.time() - val_start
        run.epoch(epoch, iters, train_time, step_count * params.global_batch_size, step_count,
                  train_loss, scheduler.get_last_lr()[0], val, val_time)
        run.validation(iters, val, t2m)

    ckpt.save(iters, epoch, epoch_step)
    log.info(f"Finished {iters} iterations; peak memory {peak_memory_gb(device):.2f} GB")
    run.close()


def setup_run(params, env, device):
    """Logging on rank 0 (stdout and out.log), batch sizes, seeds; returns the run dir."""
    world_rank, world_size = comm.get_world_rank(), comm.get_world_size()
    config_logger(world_rank)
    set_batch_sizes(params, comm.get_size("dp"))
    seed_everything(params.seed)
    exp_dir = experiment_dir(params, world_size, device)
    if world_rank == 0:
        os.makedirs(exp_dir, exist_ok=True)
        log_to_file(os.path.join(exp_dir, "out.log"))
        log.info(describe_device(device))
        log.info(f"world size {world_size} ({env.launcher} launcher), "
                 f"global batch {params.global_batch_size}, local batch {params.local_batch_size}")
        params.log(log)
    return exp_dir


def main(argv=None):
    args = build_parser(__doc__.splitlines()[0]).parse_args(argv)
    params = load_params(args)
    env, device = init_process()
    setup_run(params, env, device)
    model = build_model(params, args, device)
    n_params = sum(p.numel() for p in model.parameters())
    log.info(f"Model: {n_params / 1e6:.2f} M parameters; "
             f"memory after set-up {peak_memory_gb(device):.2f} GB")
    train(params, args, device, model)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])
