"""Train the ViT with tensor (tp) and context (cp) parallelism, on top of data parallelism.

    torchrun --nproc_per_node 4 train_mp.py --config=cpu_mp --tp 2     # laptop CPU: dp = 2
    sbatch --nodes 4 submit_pm_mp.sh --config=mp --row_parallel_size=4  # SLURM cluster

World = tp x cp x dp; dp is what is left. What changes from train.py, and nothing else:
  1. process groups for tp, cp and dp (utils.comm);
  2. the model: distributed layers holding only this rank's shard of each weight;
  3. DDP averages gradients over the dp group only;
  4. one more line in the step: parameters replicated across model-parallel ranks
     (norms, biases, embeddings) get their gradient summed over those ranks;
  5. checkpoints gather shards into full tensors, so any layout can resume them.
The training loop is train.py's `train()`.
"""

import logging
import sys

import train
from distributed.helpers import gather_tensor, shard_tensor, sync_shared_gradients
from networks.vit import vit_from_params
from utils import comm
from utils.checkpoint import unwrap
from utils.cli import add_model_parallel_args, build_parser, load_params
from utils.errors import run_main
from utils.loss import l2_loss
from utils.training import autocast, init_process, peak_memory_gb

log = logging.getLogger("train_mp")


def build_model(params, args, device):
    model = vit_from_params(params).to(device)  # distributed layers when tp x cp > 1
    n_local = sum(p.numel() for p in model.parameters())
    log.info(f"Parameters on this rank: {n_local / 1e6:.2f} M; memory after model set-up "
             f"(scaffolding high-water mark) {peak_memory_gb(device):.2f} GB")
    # DDP averages gradients over the dp group only: the ranks of a model-parallel group
    # hold different shards, whose gradients must not be mixed.
    return train.wrap_model(model, params, args, device)


def train_step(model, optimizer, scaler, inp, tar, params, device, prof):
    """train.py's step plus the model-parallel gradient reduction before the update."""
    with prof.range("forward"):
        with autocast(params, device):
            gen = model(inp)
            loss = l2_loss(gen, tar)
    with prof.range("backward"):
        scaler.scale(loss).backward()
    with prof.range("model-parallel gradient reduction"):
        sync_shared_gradients(model)
    with prof.range("optimizer"):
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def layout_free_checkpoints(model):
    """Checkpoint hooks: shard <-> full tensor, by parameter name."""
    params = dict(unwrap(model).named_parameters())
    return {"to_full": lambda name, t: gather_tensor(t, params[name]),
            "to_local": lambda name, t: shard_tensor(t, params[name]).to(params[name].device)}


def main(argv=None, step_fn=train_step, optimizer_kwargs=None):
    parser = add_model_parallel_args(build_parser(__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    params = load_params(args)
    env, device = init_process(params.tp, params.cp, params.parallel_order)
    train.setup_run(params, env, device)
    log.info(f"Layout: DP = {comm.get_size('dp')}, TP = {comm.get_size('tp')}, "
             f"CP = {comm.get_size('cp')} (order {params.parallel_order})")
    model = build_model(params, args, device)
    train.train(params, args, device, model, step_fn=step_fn,
                checkpoint_hooks=layout_free_checkpoints(model),
                optimizer_kwargs=optimizer_kwargs)


if __name__ == "__main__":
    run_main(main, sys.argv[1:])  # exit code 0, 2 (user error) or 3 (preempted)
