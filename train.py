"""Train the weather forecaster (the config's `model`: ViT or AFNO) on one device, or DDP.

    python train.py --config=cpu_short                          # one process (CPU or GPU)
    torchrun --nproc_per_node 2 train.py --config=cpu_bs32_opt  # data parallel
    sbatch -N 4 submit_pm_dp.sh --config=bs256_opt               # on a SLURM cluster

Input: all 20 ERA5 fields at time t. Target: the same fields 6 hours later.
What a run is made of (loaders, optimizer, checkpoints, ...) is built by
`utils.training.build_training`; the loop below is the whole of training.
train_mp.py reuses `train()` and changes only the model and the step.
"""

if __name__ == "__main__":
    # First of all, before the heavy imports: a SIGUSR1/SIGTERM during start-up now ends the
    # run with one line and exit code 3 instead of killing it silently (utils/run/signals.py).
    from utils.run.signals import stop_during_startup

    stop_during_startup()

import logging
import os
import sys
import time

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. On a CPU shared
# with other jobs (a laptop, a small VM) a spinning thread holds the core its partner
# thread needs, and a 2-thread CPU step ran 2-4x slower. Set OMP_WAIT_POLICY to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from networks import build_model
from utils import comm
from utils.cli import build_parser, load_params
from utils.evaluation import validate
from utils.model_wrappers import uncompiled
from utils.run.compile_cost import StartupReport
from utils.run.main import run_main
from utils.run.setup import peak_memory_gb, setup_run
from utils.training import Training, build_training, train_step, wrap_model

log = logging.getLogger("train")


def train(params, device, model, step=train_step, checkpoint_hooks=None, capturable=False,
          tile=None):
    """The training loop: `num_iters` optimizer steps, in epochs over the training data.
    `step`, the checkpoint hooks and the `tile` of the grid each rank holds (spatial
    parallelism) are what the model-parallel and CUDA-graph scripts swap in."""
    run = build_training(params, device, model, checkpoint_hooks, capturable, tile)
    if hasattr(step, "prepare"):  # train_mp_graphs.py: capture the CUDA graph before the loop
        step.prepare(run)
    progress, startup = run.progress, StartupReport(params)
    if progress.iters == 0:  # step 0: every curve starts from the untrained model
        end_of_epoch(run, train_loss=None)
    log.info(f"Starting training loop: {params.num_iters} iterations, "
             f"{run.steps_per_epoch} per epoch")
    for epoch in run.epochs():  # a resumed run continues mid-epoch
        run.model.train()
        run.prof.epoch_start(epoch, run.last_epoch)
        start, steps = time.time(), 0
        for inp, tar in run.batches():
            with run.prof.range(f"step {progress.iters}"):
                with run.prof.range("data copy in"):
                    inp = inp.to(device, non_blocking=True)
                    tar = tar.to(device, non_blocking=True)
                loss = step(run, inp, tar)
            run.scheduler.step()
            progress.record(loss)
            steps += 1
            if progress.iters == 1:
                log.info(f"Memory after the first step {peak_memory_gb(device):.2f} GB")
            run.guard.after_step(progress, loss)  # NaN check, stop signal, checkpoints
            startup.after_step(run.log, progress.iters)  # time to first step, compile time
        run.prof.epoch_end()
        run.guard.check_finite()
        end_of_epoch(run, train_loss=progress.loss_sum / max(progress.step_count, 1),
                     train_time=time.time() - start, steps=steps)
    run.ckpt.save(progress)
    log.info(f"Finished {progress.iters} iterations; peak memory {peak_memory_gb(device):.2f} GB")
    startup.at_end()
    run.close()


def end_of_epoch(run: Training, train_loss, train_time: float = 0.0, steps: int = 0) -> None:
    """Validation and the epoch's log lines and TensorBoard scalars (train_loss None: the
    initial validation of an untrained model)."""
    val_start = time.time()
    # Eagerly, without torch.compile: evaluation (no_grad, eval mode) would compile a second
    # graph of the model (~30 s cold on a 2-core CPU) to save ~0.02 s per validation.
    val = validate(uncompiled(run.model), run.val_loader, run.device, run.params, run.norm,
                   tile=run.tile)
    val_time = time.time() - val_start
    iters, t2m = run.progress.iters, run.norm.channel(2)
    if train_loss is None:
        run.log.scalars(0, {"Loss/train": val["loss"]})
        log.info(f"Initial val loss={val['loss']:.6f}, RMSE(u10m)={val['rmse_u10m']:.4f} m/s "
                 f"(persistence {val['persistence_rmse_u10m']:.4f} m/s)")
    else:  # the epoch's mean loss, averaged over the data-parallel ranks for the log
        train_loss = comm.mean_over(train_loss.reshape(1), "dp").item()
        run.log.epoch(run.progress.epoch, iters, max(train_time, 1e-9),
                      steps * run.params.global_batch_size, steps, train_loss,
                      run.scheduler.get_last_lr()[0], val, val_time)
    run.log.validation(iters, val, t2m)


def main(argv=None):
    params = load_params(build_parser(__doc__.splitlines()[0]).parse_args(argv))
    env, device = comm.init_process()
    setup_run(params, env, device)
    model = wrap_model(build_model(params).to(device), params, device)
    n_params = sum(p.numel() for p in model.parameters())
    log.info(f"Model: {n_params / 1e6:.2f} M parameters; "
             f"memory after set-up {peak_memory_gb(device):.2f} GB")
    train(params, device, model)


if __name__ == "__main__":
    run_main(main, sys.argv[1:])  # exit code 0, 2 (user error) or 3 (preempted)
