"""One training step, written once. `forward_backward` is the step's body: the eager step
runs it, and train_mp_graphs.py captures the very same body in a CUDA graph.

    (an ensemble: its members' noise, drawn before the step: `member_noise`)  ->
    forward (autocast)  ->  the run's loss  ->  scaled backward  ->  the layout's
    after-backward (model-parallel and ensemble gradient sums)  ->  optimizer step (the
    layout's loss scaler: skipped by every rank of the model replica if any of them
    overflowed)
"""

from __future__ import annotations

from typing import Any

import torch

from networks.ensemble import TRAINING
from networks.rollout import rollout
from training.run import Training
from training.setup import memory_since_reset


def member_noise(run: Any, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor | None:
    """The noise of this step's ensemble members (networks/ensemble.py), None for a
    deterministic model (a run without `members`, as the benchmarks' stand-ins): keyed by
    the seed, the iteration, each sample's place in the global batch, the member and the
    rollout step. Drawn here, before the forward pass, so that no recompute, compiled graph
    or captured CUDA graph draws random numbers of its own."""
    members = getattr(run, "members", None)
    if members is None:
        return None
    steps = tar.shape[1] if tar.dim() > inp.dim() else 1
    return members.noise(TRAINING, run.progress.iters, members.samples(0, inp.shape[0]),
                         steps, inp.device)


def rollout_loss(model: torch.nn.Module, inp: torch.Tensor, tar: torch.Tensor,
                 loss_fn: torch.nn.Module, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over k of loss_fn(x_k, target_k), x_k the model applied k times to `inp`
    (B, C, H, W); `tar` is (B, K, C, H, W). Gradients flow through every step, so the
    model learns from the errors its own output feeds into the next step. An ensemble's
    members (`noise`, networks/rollout.py) each roll out; x_k is then (B, M, C, H, W)."""
    preds = rollout(model, inp, tar.shape[1], noise)
    losses = [loss_fn(preds[:, k], tar[:, k]) for k in range(tar.shape[1])]
    return torch.stack(losses).mean()


def forward_backward(run: Training, inp: torch.Tensor, tar: torch.Tensor,
                     noise: torch.Tensor | None = None) -> torch.Tensor:
    """Forward under autocast, the run's loss (networks/loss.py), scaled backward, the
    layout's gradient completion. A target with a step axis (B, K, C, H, W) (`rollout_steps`
    K > 1) trains on the mean loss of a K-step rollout; an ensemble's members each forecast
    with their `noise` (`member_noise`). Returns the loss (still attached)."""
    with run.prof.range("forward"), run.ctx.precision.autocast():
        if tar.dim() == inp.dim() and noise is None:
            loss = run.loss(run.model(inp), tar)
        else:
            steps = tar if tar.dim() > inp.dim() else tar.unsqueeze(1)
            loss = rollout_loss(run.model, inp, steps, run.loss, noise)
    with run.prof.range("backward"):
        run.scaler.scale(loss).backward()
    if run.layout.reduces_after_backward:
        with run.prof.range("gradient sums over mp and ens"):
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
        loss = forward_backward(run, inp, tar, member_noise(run, inp, tar))
        optimizer_step(run)
        return loss.detach()

    def measured_memory(self, device: torch.device) -> tuple[str, dict[str, float]]:
        """The memory of the warm step the log reports beside the planner's eager step, and
        how it was measured: here the step's own peak (reset just before it)."""
        return "its own peak, reset once warm", memory_since_reset(device)
