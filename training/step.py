"""One training step, written once. `forward_backward` is the step's body: the eager step
runs it, and train_mp_graphs.py captures the very same body in a CUDA graph.

    forward (autocast)  ->  the run's loss  ->  scaled backward  ->  the layout's
    after-backward (model-parallel gradient sums)  ->  optimizer step (the layout's loss
    scaler: skipped by every rank of the model replica if any of them overflowed)
"""

from __future__ import annotations

import torch

from networks.rollout import rollout
from training.run import Training


def rollout_loss(model: torch.nn.Module, inp: torch.Tensor, tar: torch.Tensor,
                 loss_fn: torch.nn.Module) -> torch.Tensor:
    """Mean over k of loss_fn(x_k, target_k), x_k the model applied k times to `inp`
    (B, C, H, W); `tar` is (B, K, C, H, W). Gradients flow through every step, so the
    model learns from the errors its own output feeds into the next step."""
    preds = rollout(model, inp, tar.shape[1])
    losses = [loss_fn(preds[:, k], tar[:, k]) for k in range(tar.shape[1])]
    return torch.stack(losses).mean()


def forward_backward(run: Training, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
    """Forward under autocast, the run's loss (networks/loss.py), scaled backward, the
    layout's gradient completion. A target with a step axis (B, K, C, H, W) (`rollout_steps`
    K > 1) trains on the mean loss of a K-step rollout. Returns the loss (still attached)."""
    with run.prof.range("forward"), run.ctx.precision.autocast():
        if tar.dim() == inp.dim():
            loss = run.loss(run.model(inp), tar)
        else:
            loss = rollout_loss(run.model, inp, tar, run.loss)
    with run.prof.range("backward"):
        run.scaler.scale(loss).backward()
    if run.layout.is_model_parallel:
        with run.prof.range("model-parallel gradient reduction"):
            run.layout.after_backward(run.model)
    return loss


def optimizer_step(run: Training, zero_grad: bool = True) -> None:
    """The update: with fp16 loss scaling, unscale and skip a step whose gradients
    overflowed on any rank of the model replica (the layout's scaler makes the ranks agree:
    `Layout.grad_scaler`). `zero_grad` False leaves the gradients where a CUDA graph writes
    them."""
    with run.prof.range("optimizer"):
        run.scaler.step(run.optimizer)
        run.scaler.update()
        if zero_grad:
            run.optimizer.zero_grad(set_to_none=True)


class Step:
    """The eager training step, `step(run, inp, tar) -> loss`; train_mp_graphs.py's
    `GraphedStep` replaces it. `prepare` runs once before the loop; `capturable` asks for an
    optimizer whose step can live in a CUDA graph."""

    capturable = False

    def prepare(self, run: Training) -> None:
        """Nothing to prepare for an eager step."""

    def __call__(self, run: Training, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        loss = forward_backward(run, inp, tar)
        optimizer_step(run)
        return loss.detach()
