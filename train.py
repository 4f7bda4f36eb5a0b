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

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. On a CPU shared
# with other jobs (a laptop, a small VM) a spinning thread holds the core its partner
# thread needs, and a 2-thread CPU step ran 2-4x slower. Set OMP_WAIT_POLICY to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from networks.vit import vit_from_params
from utils import comm
from utils.checkpoint import Checkpointer, resolve_resume
from utils.cli import build_parser, load_params, set_batch_sizes
from utils.data_loader import DataError, get_data_loader
from utils.errors import run_main
from utils.logging_utils import config_logger, log_to_file
from utils.loss import l2_loss
from utils.preemption import EXIT_PREEMPTED, StopSignal, requeue_slurm_job
from utils.profiling import StepProfiler
from utils.run_log import RunLog
from utils.training import (
    NonFiniteLoss,
    Normaliser,
    autocast,
    build_optimizer,
    build_scheduler,
    describe_device,
    experiment_dir,
    grad_scaler,
    init_process,
    peak_memory_gb,
    seed_everything,
    settle,
    validate,
)
from utils.YParams import ConfigError

log = logging.getLogger("train")


def build_model(params, args, device):
    return wrap_model(vit_from_params(params).to(device), params, args, device)


def wrap_model(model, params, args, device):
    """DDP over the data-parallel group (every rank here; train_mp.py's dp group), then
    torch.compile."""
    if comm.get_size("dp") > 1 and not args.noddp:
        # DDP all-reduces gradients bucket by bucket while backward is still running.
        model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            process_group=comm.get_group("dp"), bucket_cap_mb=args.bucket_cap_mb,
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
    # SIGUSR1/SIGTERM from here on: a checkpoint at the next step (utils/preemption.py).
    # Installed before the data loaders fork their workers, which inherit the handler.
    stop = StopSignal()

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
    # Where the loop stands: iterations done, the current epoch, batches done in it, and
    # this rank's loss summed over them. A checkpoint holds all of it (a resume continues
    # mid-epoch and logs the same epoch averages).
    iters, epoch, epoch_step = 0, 0, 0
    loss_sum, step_count = torch.zeros((), device=device), 0
    resume = resolve_resume(args.resume, exp_dir, requeue=args.requeue)
    if resume:
        state = ckpt.restore(resume)
        iters, epoch, epoch_step = state["iters"], state["epoch"], state["epoch_step"]
        loss_sum, step_count = state["loss_sum"], state["step_count"]
    ckpt.start_at(iters)  # set aside checkpoints of an earlier run beyond this point
    nonfinite = NonFiniteLoss(device)
    prof = StepProfiler(device, exp_dir, rank=world_rank)
    # purge_step: a resumed run first drops the TensorBoard events that the interrupted run
    # wrote after its checkpoint, so that every curve is one line without repeated steps.
    # Events at step `iters` itself are kept, unless that step's end-of-epoch work is still
    # to do (epoch_step != 0): then this run writes them again.
    purge = (iters if epoch_step else iters + 1) if resume else None
    run = RunLog(exp_dir, enabled=world_rank == 0, purge_step=purge)
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
    if steps_per_epoch == 0:
        raise DataError(f"{params.train_data_path}: fewer training samples per data-parallel "
                        f"rank than the local batch size {params.local_batch_size}")
    last_epoch = math.ceil(params.num_iters / steps_per_epoch)
    interval = int(params.checkpoint_interval or 0)
    log.info(f"Starting training loop: {params.num_iters} iterations, "
             f"{steps_per_epoch} per epoch")
    # epoch_step != 0 only when a resumed run starts inside an epoch: it finishes that epoch
    # (at least its end-of-epoch work, when the checkpoint came at its last step) first.
    while iters < params.num_iters or epoch_step != 0:
        if epoch_step == 0:  # the previous epoch is complete: start the next one
            epoch, loss_sum, step_count = epoch + 1, torch.zeros((), device=device), 0
        train_sampler.set_epoch(epoch, skip_batches=epoch_step)  # skip the batches done
        model.train()
        prof.epoch_start(epoch, last_epoch)
        start, timed_steps = time.time(), 0
        for inp, tar in train_loader if iters < params.num_iters else ():
            with prof.range(f"step {iters}"):
                with prof.range("data copy in"):
                    inp = inp.to(device, non_blocking=True)
                    tar = tar.to(device, non_blocking=True)
                loss = step_fn(model, optimizer, scaler, inp, tar, params, device, prof)
            scheduler.step()
            loss_sum += loss
            iters, epoch_step, step_count = iters + 1, epoch_step + 1, step_count + 1
            timed_steps += 1
            nonfinite.record(loss, iters)  # on the device: no host sync here
            if iters == 1:
                log.info(f"Memory after the first step {peak_memory_gb(device):.2f} GB")
            # Every rank agrees (one all-reduce; every 10th step on a GPU) whether any rank
            # got SIGUSR1/SIGTERM.
            stopping = stop.should_stop(device, iters)
            save = stopping or (interval > 0 and iters % interval == 0
                                and iters < params.num_iters)  # the end saves anyway
            if save or nonfinite.due(iters):
                nonfinite.check(ckpt.last_saved)  # never save after a NaN/inf loss
            if save:
                ckpt.save(iters, epoch, epoch_step, loss_sum, step_count)
            if stopping:
                log.info(f"Signal {stop.received} received: stopped at iteration {iters}")
                if args.requeue and world_rank == 0:
                    requeue_slurm_job()
                sys.exit(EXIT_PREEMPTED)
            if iters >= params.num_iters:
                break
        prof.epoch_end()
        nonfinite.check(ckpt.last_saved)
        train_time = max(time.time() - start, 1e-9)
        train_loss = loss_sum / max(step_count, 1)
        if distributed:  # average over data-parallel ranks for the log
            dist.all_reduce(train_loss, group=comm.get_group("dp"))
            train_loss /= comm.get_size("dp")
        train_loss = train_loss.item()

        val_start = time.time()
        val = validate(model, val_loader, device, params, norm, comm.get_group("dp"))
        val_time = time.time() - val_start
        run.epoch(epoch, iters, train_time, timed_steps * params.global_batch_size, timed_steps,
                  train_loss, scheduler.get_last_lr()[0], val, val_time)
        run.validation(iters, val, t2m)
        epoch_step = 0  # this epoch is done, end-of-epoch work included

    ckpt.save(iters, epoch, epoch_step, loss_sum, step_count)
    log.info(f"Finished {iters} iterations; peak memory {peak_memory_gb(device):.2f} GB")
    run.close()


def setup_run(params, env, device):
    """Logging on rank 0 (stdout and out.log), batch sizes, seeds; returns the run dir."""
    world_rank, world_size = comm.get_world_rank(), comm.get_world_size()
    config_logger(world_rank)
    set_batch_sizes(params, comm.get_size("dp"))
    seed_everything(params.seed)
    exp_dir = experiment_dir(params, world_size, device)
    error: list[str | None] = [None]
    if world_rank == 0:
        try:
            os.makedirs(exp_dir, exist_ok=True)
            log_to_file(os.path.join(exp_dir, "out.log"))
        except OSError as e:
            error[0] = f"cannot write the run directory {exp_dir} ({e.strerror or e}): " \
                       "set LOG_DIR (or expdir in the config) to a writable directory"
    if dist.is_initialized():  # every rank stops with rank 0, none waits for it
        dist.broadcast_object_list(error, src=0)
    if error[0]:
        settle()  # the broadcast's last traces are gone before the ranks exit
        raise ConfigError(error[0])
    if world_rank == 0:
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


if __name__ == "__main__":
    run_main(main, sys.argv[1:])  # exit code 0, 2 (user error) or 3 (preempted)
