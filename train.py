"""Train the weather forecaster (the config's `model`: ViT or AFNO) on one device, or DDP.

    python train.py --config=cpu_short                          # one process (CPU or GPU)
    torchrun --nproc_per_node 2 train.py --config=cpu_bs32_opt  # data parallel
    torchrun --nproc_per_node 2 train.py --config=cpu_bs32_opt --fsdp   # ... model sharded
    sbatch -N 4 submit_pm_dp.sh --config=bs256_opt               # on a SLURM cluster

When it does not fit: --activation_checkpointing blocks, --fsdp (docs/memory.md).

Input: all 20 ERA5 fields at time t. Target: the same fields 6 hours later.
What a run is made of (loaders, optimizer, checkpoints, ...) is built by
`training.run.build_training`; the loop below is the whole of training.
train_mp.py reuses `train()` with a model-parallel layout.
"""

if __name__ == "__main__":
    # First of all, before torch is imported (training/startup.py): a stop signal ends the
    # start-up with one line; the command line's config is read and checked (a bad one: one
    # `error:` line per job); OpenMP's idle threads get their wait policy.
    from training.startup import start

    cfg = start(__doc__)

import logging
import time

from distributed.layout import Layout
from planning.memory import step_memory_line
from training.loop_report import LoopReport
from training.run import build_training, build_wrapped_model
from training.script_exit import run_main
from training.setup import start_run
from training.step import Step
from utils.config_schema import Config

log = logging.getLogger("train")


def train(cfg: Config, layout: Layout, step: Step | None = None) -> None:
    """The training loop: `num_iters` optimizer steps, in epochs over the training data.
    The layout says how the model and its data are split over the job's processes;
    train_mp_graphs.py passes a `step` that replays a CUDA graph."""
    step = step or Step()
    ctx = start_run(cfg, layout)  # logging, seeds, batch sizes, precision, run directory
    model = build_wrapped_model(cfg, layout)  # the layout's layers; DDP or FSDP over dp; compile
    run = build_training(cfg, ctx, layout, model, capturable=step.capturable)
    step.prepare(run)  # train_mp_graphs.py: capture the CUDA graph before the loop
    progress = run.progress
    # time to the first step, step 2's memory beside the planner's estimate, compile time
    report = LoopReport(run, step, memory_line=step_memory_line)
    if progress.iters == 0 and not cfg.skip_initial_validation:
        run.end_of_epoch()  # step 0: every curve starts from the untrained model
    log.info(f"Starting training loop: {cfg.num_iters} iterations, "
             f"{run.steps_per_epoch} per epoch")
    for epoch in run.epochs():  # a resumed run continues mid-epoch
        run.model.train()
        run.prof.epoch_start(epoch, run.last_epoch)
        start, steps = time.time(), 0
        for inp, tar in run.batches():
            with report.around_step(progress), run.prof.range(f"step {progress.iters}"):
                loss = step(run, inp, tar)
            run.scheduler.step()
            progress.record(loss)
            steps += 1
            run.guard.after_step(progress, loss)  # NaN check, stop signal, checkpoints
        run.prof.epoch_end()
        run.guard.check_finite()
        run.end_of_epoch(time.time() - start, steps)  # validation, logs, TensorBoard
    run.finish()  # the final checkpoint
    report.at_end()


def main(cfg: Config) -> None:
    train(cfg, Layout.data_parallel(cfg))  # one process group over every rank: DDP


if __name__ == "__main__":
    run_main(main, cfg)  # exit code 0, 2 (user error) or 3 (preempted)
