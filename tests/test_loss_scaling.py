"""distributed/loss_scaling.py's AgreedGradScaler on real gloo ranks: every rank joins the
overflow verdict, also a rank whose optimizer holds no gradient at all (its parameters took
no part in this step's loss), so its peers never wait for it in the all-reduce."""

from __future__ import annotations

import pytest
import torch
from helpers import run_distributed

from distributed.loss_scaling import AgreedGradScaler

INIT_SCALE = 1024.0


def _one_rank_without_gradients(fused: bool) -> dict:
    """Rank 0 backpropagates (an inf in its gradient at the first step only); rank 1 holds
    parameters that got no gradient. Both step twice; what each saw."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused or None)
    scaler = AgreedGradScaler("cpu", group=None, init_scale=INIT_SCALE)
    seen = []
    for step in range(2):
        before = [p.detach().clone() for p in model.parameters()]
        loss = model(torch.ones(2, 4)).sum()
        scaled = scaler.scale(loss)
        if rank == 0:
            scaled.backward()
            if step == 0:
                model.weight.grad.view(-1)[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        seen.append({"scale": scaler.get_scale(), "moved": moved})
    return {"rank": rank, "steps": seen}


@pytest.mark.distributed
@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused_adam"])
def test_a_rank_without_gradients_joins_the_overflow_verdict(fused):
    """Both ranks back off at the overflow of rank 0 (same scale after it), rank 0 skips
    that step and takes the next; rank 1 has nothing to update, and does not hang its peer
    (nor fail GradScaler's "No inf checks were recorded")."""
    ranks = run_distributed(_one_rank_without_gradients, 2, fused, timeout=60)
    for r in ranks:
        assert [s["scale"] for s in r["steps"]] == [INIT_SCALE / 2] * 2, r
    assert [s["moved"] for s in ranks[0]["steps"]] == [False, True]
    assert [s["moved"] for s in ranks[1]["steps"]] == [False, False]
