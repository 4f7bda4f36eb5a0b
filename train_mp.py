"""Train with model parallelism on top of data parallelism: the ViT with tensor (tp) and
context (cp) parallelism, or the AFNO with its grid split over an h x w mesh (spatial).

    torchrun --nproc_per_node 4 train_mp.py --config=cpu_mp --tp 2     # laptop CPU: dp = 2
    sbatch --nodes 4 submit_pm_mp.sh --config=mp --row_parallel_size=4  # SLURM cluster
    torchrun --nproc_per_node 4 train_mp.py --config=cpu_afno --h_parallel_size 2 \\
        --w_parallel_size 2                                            # AFNO on a 2 x 2 mesh

World = tp x cp x h x w x dp; dp is what is left. What changes from train.py is the layout
(distributed/layout.py), and nothing else:
  1. the flags --tp, --cp, --h_parallel_size, --w_parallel_size, --parallel_order;
  2. process groups for tp, cp, h, w and dp; DDP (or FSDP, --fsdp) reduces gradients
     over dp only;
  3. the model's layers: `DistributedLayers` (ViT), whose layers hold only this rank's
     shard of each weight, or `SpatialLayers` (AFNO), whose layers work on this rank's
     tile of the grid (both initialised to exactly the serial model's numbers);
  4. after backward, parameters replicated across model-parallel ranks (norms, biases,
     embeddings) get their gradient summed over those ranks; on a spatial mesh the loss
     and the scores also sum over the tiles, and each rank reads only its tile;
  5. checkpoints gather shards into full tensors, so any layout resumes any checkpoint.
The training loop is train.py's `train()`.
"""

if __name__ == "__main__":
    # First of all, before torch is imported (training/startup.py): a stop signal ends the
    # start-up with one line; the command line's config is read and checked (a bad one: one
    # `error:` line per job); OpenMP's idle threads get their wait policy.
    from training.startup import start

    cfg = start(__doc__, model_parallel=True)

import train
from distributed.layout import Layout
from training.script_exit import run_main
from training.step import Step
from utils.config_schema import Config


def main(cfg: Config, step: Step | None = None) -> None:
    train.train(cfg, Layout.model_parallel(cfg), step)  # tp x cp x h x w x dp groups


if __name__ == "__main__":
    run_main(main, cfg)  # exit code 0, 2 (user error) or 3 (preempted)
