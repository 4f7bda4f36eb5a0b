"""The stack of blocks both networks run, with or without activation checkpointing.

Backward needs what each block computed in the forward pass (the inputs of its matmuls,
norms and activations). Kept, these are most of a rank's memory at the tutorial's sizes
(docs/memory.md). With `checkpoint`, a block keeps only its input; its backward first runs
the block's forward again (`torch.utils.checkpoint`, non-reentrant), then differentiates it:
one more forward pass of compute for the activations of one block instead of all of them.

The recomputed forward is the same computation on the same input, so it gives the same
numbers bit for bit: the collectives inside a tensor-, context- or spatially-parallel block
(all-reduce, all-gather, all-to-all) run again, in the same order on every rank of their
group, and sum the same values in the same order (tests/test_activation_checkpointing.py).
Dropout draws the same mask again: checkpoint restores the RNG state it saw in the forward.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def run_blocks(blocks: Iterable[nn.Module], x: torch.Tensor, recompute: bool,
               cond: torch.Tensor | None = None) -> torch.Tensor:
    """x through every block in turn; `recompute`: each block's activations are recomputed
    in backward instead of kept (only when a backward can follow: under no_grad there is
    nothing to keep). `cond`: an ensemble member's noise embedding, given to every block
    (networks/noise.py); a recompute gets the same tensor, as the noise was drawn before."""
    recompute = recompute and torch.is_grad_enabled()
    for block in blocks:
        args = (x,) if cond is None else (x, cond)
        x = checkpoint(block, *args, use_reentrant=False) if recompute else block(*args)
    return x
