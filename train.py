"""Train the ViT weather forecaster on one device, or data-parallel with DDP.

    python train.py --config=cpu_short                          # one process (CPU or GPU)
    torchrun --nproc_per_node 2 train.py --config=cpu_bs32_opt  # data parallel
    sbatch -N 4 submit_pm_dp.sh --config=bs256_opt               # on a SLURM cluster

Input: all 20 ERA5 fields at time t. Target: the same fields 6 hours later.
"""

import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from networks.vit import vit_from_params
from utils import comm
from utils.cli import build_parser, load_params, set_batch_sizes
from utils.data_loader import get_data_loader
from utils.errors import exit_on_user_error
from utils.logging_utils import config_logger, log_to_file
from utils.loss import l2_loss
from utils.run_log import RunLog
from utils.training import (Normaliser, autocast, build_optimizer, build_scheduler,
                            describe_device, experiment_dir, grad_scaler, init_process,
                            peak_memory_gb, seed_everything, validate)

log = logging.getLogger("train")


def train_step(model, optimizer, scaler, inp, tar, params, device):
    """One optimizer step: forward under autocast, scaled backward (DDP all-reduces the
    gradients during it), optimizer step, gradients reset."""
    with autocast(params, device):
        gen = model(inp)
        loss = l2_loss(gen, tar)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def main(argv=None):
    args = build_parser(__doc__.splitlines()[0]).parse_args(argv)
    params = load_params(args)
    env, device = init_process()
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

    # ---- data: every data-parallel rank reads a disjoint shard of each epoch
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

    # ---- model, optimizer, schedule
    model = vit_from_params(params).to(device)
    if distributed and not args.noddp:
        model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=args.bucket_cap_mb,
            broadcast_buffers=not args.disable_broadcast_buffers,
            gradient_as_bucket_view=args.disable_broadcast_buffers)
    if params.enable_jit:
        model = torch.compile(model)
    optimizer = build_optimizer(params, model)
    scheduler = build_scheduler(params, optimizer)
    scaler = grad_scaler(params, device)
    run = RunLog(exp_dir, enabled=world_rank == 0)
    n_params = sum(p.numel() for p in model.parameters())
    log.info(f"Model: {n_params / 1e6:.2f} M parameters; "
             f"memory after set-up {peak_memory_gb(device):.2f} GB")

    # ---- step 0: initial losses, so every curve starts from the untrained model
    t2m = (norm.means[0, 2].item(), norm.stds[0, 2].item())
    val = validate(model, val_loader, device, params, norm, comm.get_group("dp"))
    run.scalars(0, {"Loss/train": val["loss"]})
    run.validation(0, val, t2m)
    log.info(f"Initial val loss={val['loss']:.6f}, RMSE(u10m)={val['rmse_u10m']:.4f} m/s "
             f"(persistence {val['persistence_rmse_u10m']:.4f} m/s)")

    # ---- training loop: num_iters optimizer steps, split into epochs over the data
    iters, epoch = 0, 0
    log.info("Starting training loop...")
    while iters < params.num_iters:
        epoch += 1
        train_sampler.set_epoch(epoch)
        model.train()
        start, step_count = time.time(), 0
        loss_sum = torch.zeros((), device=device)
        for inp, tar in train_loader:
            inp = inp.to(device, non_blocking=True)
            tar = tar.to(device, non_blocking=True)
            loss = train_step(model, optimizer, scaler, inp, tar, params, device)
            scheduler.step()
            loss_sum += loss
            iters += 1
            step_count += 1
            if iters == 1:
                log.info(f"Memory after the first step {peak_memory_gb(device):.2f} GB")
            if iters >= params.num_iters:
                break
        train_time = time.time() - start
        train_loss = loss_sum.item() / max(step_count, 1)
        if distributed:  # average over data-parallel ranks for the log
            t = torch.tensor([train_loss], device=device)
            dist.all_reduce(t, group=comm.get_group("dp"))
            train_loss = t.item() / comm.get_size("dp")
        if not torch.isfinite(torch.tensor(train_loss)):
            raise FloatingPointError(f"training loss is {train_loss} in epoch {epoch}: "
                                     "stopping (lower the lr or use bf16 instead of fp16)")

        val_start = time.time()
        val = validate(model, val_loader, device, params, norm, comm.get_group("dp"))
        val_time = time.time() - val_start
        samples = step_count * params.global_batch_size
        run.epoch(epoch, iters, train_time, samples, step_count, train_loss,
                  scheduler.get_last_lr()[0], val, val_time)
        run.validation(iters, val, t2m)

    log.info(f"Finished {iters} iterations; peak memory {peak_memory_gb(device):.2f} GB")
    run.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])
