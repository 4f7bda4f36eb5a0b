"""fp16 loss scaling with one overflow verdict for a group of ranks that share a loss.

`torch.amp.GradScaler` looks for inf/NaN only in the gradients its own rank holds, and skips
the step (and halves the scale) on that finding alone. On a model-parallel layout each rank
holds gradients no other rank sees: its shard of the column- and row-parallel weights (tp),
its tile's parameters (h x w). One overflowing shard would make its rank skip a step that
the others take, and from then on the ranks scale their losses differently, so every
all-reduce of the backward adds gradients scaled by different factors. Nothing would say so.

`AgreedGradScaler` all-reduces the found-inf flags with MAX over the group as soon as the
scaler has computed them, so every rank of the group steps, or skips and backs off, alike
(Megatron-LM does the same over its model-parallel group). Data-parallel replicas need no
such agreement: DDP has averaged their gradients, so an inf on one is an inf on all.

Why not PyTorch's `torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` (same
purpose): it sums the flags (a verdict of 2.0 on two ranks) into a tensor of shape (1,).
Fused Adam (`--enable_fused`) skips its update only for a flag of exactly 1 and subtracts
the flag from its step counters, which must broadcast to their shape (): with
ShardedGradScaler, fused Adam fails with a shape error, and would otherwise step on inf
gradients. MAX keeps the flag a 0-d tensor of 0 or 1, as GradScaler makes it.

The hook point is `_unscale_grads_`, the method that computes the flags for both ways a
step reaches them: `unscale_` (plain Adam, or a step that unscales to clip gradients) and
fused Adam's in-kernel unscaling. It is what ShardedGradScaler itself overrides; the
distributed tests (tests/test_fp16_overflow.py) catch any change of it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class AgreedGradScaler(torch.amp.GradScaler):
    """A GradScaler whose found-inf flags are the MAX over the ranks of `group`: every rank
    of the group skips a step if any of them overflowed. Collective: every rank of the
    group must step (or unscale) together, as they do in training."""

    def __init__(self, device: str, group: dist.ProcessGroup | None, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self.group = group

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool
                        ) -> dict[torch.device, torch.Tensor]:
        """GradScaler's unscaling (and finding of inf/NaN) on this rank's gradients, then
        the group's verdict: each flag (one per device) all-reduced with MAX, in place."""
        found = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        for flag in found.values():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return found
