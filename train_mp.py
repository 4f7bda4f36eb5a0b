"""Train with model parallelism on top of data parallelism: the ViT with tensor (tp) and
context (cp) parallelism, or the AFNO with its grid split over an h x w mesh (spatial).

    torchrun --nproc_per_node 4 train_mp.py --config=cpu_mp --tp 2     # laptop CPU: dp = 2
    sbatch --nodes 4 submit_pm_mp.sh --config=mp --row_parallel_size=4  # SLURM cluster
    torchrun --nproc_per_node 4 train_mp.py --config=cpu_afno --h_parallel_size 2 \\
        --w_parallel_size 2                                            # AFNO on a 2 x 2 mesh

World = tp x cp x h x w x dp; dp is what is left. What changes from train.py, and nothing else:
  1. process groups for tp, cp, h, w and dp (`comm.init_process(tp, cp, order, h, w)`);
  2. the model: built with `DistributedLayers` (ViT), whose layers hold only this rank's
     shard of each weight, or `SpatialLayers` (AFNO), whose layers work on this rank's
     tile of the grid (initialised to exactly the serial model's numbers);
  3. DDP averages gradients over the dp group only (`wrap_model` uses comm's dp group);
  4. one hook in the step: parameters replicated across model-parallel ranks (norms,
     biases, embeddings) get their gradient summed over those ranks; on a spatial mesh the
     loss also sums over the tiles;
  5. checkpoints gather shards into full tensors, so any layout can resume them;
  6. spatial only: each rank reads, trains on and scores its tile of every field.
The training loop is train.py's `train()`.
"""

if __name__ == "__main__":
    # First of all, before the heavy imports: a SIGUSR1/SIGTERM during start-up now ends the
    # run with one line and exit code 3 instead of killing it silently (utils/run/signals.py).
    from utils.run.signals import stop_during_startup

    stop_during_startup()

import functools
import logging
import sys

import networks
import train
from distributed import spatial_metrics
from distributed.helpers import gather_tensor, shard_tensor, sync_shared_gradients
from distributed.layers import DistributedLayers
from distributed.spatial import SpatialLayers, field_tile
from utils import comm
from utils.cli import add_model_parallel_args, build_parser, load_params
from utils.model_wrappers import unwrap
from utils.run.main import run_main
from utils.run.setup import peak_memory_gb, setup_run
from utils.training import train_step, wrap_model

log = logging.getLogger("train_mp")

# train.py's step plus the model-parallel gradient reduction between backward and update.
mp_train_step = functools.partial(train_step, after_backward=sync_shared_gradients)
# On a spatial mesh each rank's batch is its tile: the loss sums over the mesh.
spatial_train_step = functools.partial(mp_train_step, loss_fn=spatial_metrics.l2_loss)


def is_spatial() -> bool:
    return comm.get_size("h-w") > 1


def layers():
    """The layer factory of this layout (the config schema allows h x w > 1 only for the
    AFNO, tp x cp > 1 only for the ViT); None: serial layers."""
    if is_spatial():
        return SpatialLayers()
    if comm.get_size("tp-cp") > 1:
        return DistributedLayers()
    return None


def build_model(params, device):
    model = networks.build_model(params, layers=layers()).to(device)
    n_local = sum(p.numel() for p in model.parameters())
    log.info(f"Parameters on this rank: {n_local / 1e6:.2f} M; memory after model set-up "
             f"(scaffolding high-water mark) {peak_memory_gb(device):.2f} GB")
    # DDP averages gradients over the dp group only: the ranks of a model-parallel group
    # hold different shards, whose gradients must not be mixed.
    return wrap_model(model, params, device)


def layout_free_checkpoints(model):
    """Checkpoint hooks: shard <-> full tensor, by parameter name."""
    params = dict(unwrap(model).named_parameters())
    return {"to_full": lambda name, t: gather_tensor(t, params[name]),
            "to_local": lambda name, t: shard_tensor(t, params[name]).to(params[name].device)}


def setup(argv, description):
    """Flags, process groups and run set-up of a model-parallel job."""
    params = load_params(add_model_parallel_args(build_parser(description)).parse_args(argv))
    env, device = comm.init_process(params.tp, params.cp, params.parallel_order,
                                    h=params.h_parallel_size, w=params.w_parallel_size)
    setup_run(params, env, device)
    mesh = f", H = {comm.get_size('h')}, W = {comm.get_size('w')}" if is_spatial() else ""
    log.info(f"Layout: DP = {comm.get_size('dp')}, TP = {comm.get_size('tp')}, "
             f"CP = {comm.get_size('cp')}{mesh} (order {params.parallel_order})")
    return params, device


def main(argv=None, step=None, capturable=False):
    params, device = setup(argv, __doc__.splitlines()[0])
    model = build_model(params, device)
    tile = field_tile(params.img_size, params.patch_size) if is_spatial() else None
    if step is None:
        step = spatial_train_step if tile else mp_train_step
    train.train(params, device, model, step=step,
                checkpoint_hooks=layout_free_checkpoints(model), capturable=capturable,
                tile=tile)


if __name__ == "__main__":
    run_main(main, sys.argv[1:])  # exit code 0, 2 (user error) or 3 (preempted)
