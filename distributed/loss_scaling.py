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
such agreement: DDP has averaged their gradients, so an inf on one is an inf on all. Nor,
strictly, do the ranks of an ensemble's members (ens), whose gradients are summed before
the check; they join the verdict all the same (`Layout.grad_scaler`: every rank that
shares the loss agrees, whatever the order of the sums).

Every rank of the group joins the all-reduce, also one whose optimizer holds no gradient
this step (its parameters took no part in the loss): it brings a flag of 0 on the loss
scale's device. Skipping the collective there would leave its peers waiting in theirs until
the time-out (and GradScaler would find "no inf checks recorded" on that rank).

The hook point is `_unscale_grads_`, the method that computes the flags on both ways a step
reaches them: `unscale_` (plain Adam, or a step that unscales to clip gradients) and fused
Adam's in-kernel unscaling (`GradScaler.step` -> `_check_inf_per_device`, which never calls
`unscale_`). PyTorch's `torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`
(the same purpose, for FSDP) adds the zero flag of a rank without gradients in
`_unscale_grads_` too, but all-reduces the flags in `unscale_`: on the fused path no rank
would agree. That is why the verdict is reached here. It also sums the flags (2.0 on two
ranks) where fused Adam skips its update only for a flag of exactly 1; MAX keeps the flag
0 or 1, as GradScaler makes it. The distributed tests (tests/test_fp16_overflow.py,
tests/test_loss_scaling.py) catch any change of this private method.
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
        the group's verdict: each flag (one per device) all-reduced with MAX, in place. A
        rank without gradients joins with a flag of 0 on the scale's device (`found_inf`'s)."""
        found = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if not found:
            found = {found_inf.device: torch.zeros_like(found_inf)}
        for flag in found.values():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return found
