"""DistributedMLP / DistributedAttention / DistributedLayerNorm against the serial layers of
networks.vit with copied weights: outputs, input gradients and every weight gradient
(gathered from the shards).

Tolerance (fp32): max |distributed - serial| <= 1e-5 * max |serial|, per tensor. The only
differences are summation orders (all-reduce, split matmuls), ~1e-7 relative in practice.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import assert_close_rel, run_distributed
from sharded import gather_full_grads, load_serial_state_dict

from distributed import comm
from distributed.helpers import annotation_errors, compute_split_shapes, sync_shared_gradients
from distributed.layers import (
    ColumnParallelLinear,
    DistributedAttention,
    DistributedLayerNorm,
    DistributedMLP,
    RowParallelLinear,
    TokenSplit,
)
from networks.blocks import MLP
from networks.vit import Attention

RTOL = 1e-5
DIM, HEADS, HIDDEN, BATCH = 16, 4, 32, 2


def _compare(kind: str, num_tokens: int, with_split: bool) -> None:
    torch.manual_seed(0)
    serial = {"mlp": lambda: MLP(DIM, HIDDEN), "attn": lambda: Attention(DIM, HEADS),
              "norm": lambda: nn.LayerNorm(DIM)}[kind]()
    if kind == "norm":  # non-trivial affine parameters
        nn.init.normal_(serial.weight), nn.init.normal_(serial.bias)
    tokens = TokenSplit() if with_split else None
    dist_layer = {"mlp": lambda: DistributedMLP(DIM, HIDDEN),
                  "attn": lambda: DistributedAttention(DIM, HEADS, tokens=tokens),
                  "norm": lambda: DistributedLayerNorm(DIM)}[kind]()
    assert not annotation_errors(dist_layer)
    load_serial_state_dict(dist_layer, serial.state_dict())

    x = torch.randn(BATCH, num_tokens, DIM, requires_grad=True)
    grad_out = torch.randn(BATCH, num_tokens, DIM)
    out = serial(x)
    out.backward(grad_out)

    # this cp rank's tokens, as a leaf so that its input gradient can be checked too
    sizes = compute_split_shapes(num_tokens, comm.get_size("cp"))
    mine = lambda t: t.split(sizes, dim=1)[comm.get_rank("cp")]
    if tokens is not None:
        tokens.sizes = sizes
    x_local = mine(x.detach()).clone().requires_grad_()
    out_local = dist_layer(x_local)
    out_local.backward(mine(grad_out))
    sync_shared_gradients(dist_layer)

    where = f"{kind} tp={comm.get_size('tp')} cp={comm.get_size('cp')} N={num_tokens}"
    assert_close_rel(out_local, mine(out.detach()), f"{where} output", RTOL)
    assert_close_rel(x_local.grad, mine(x.grad), f"{where} input grad", RTOL)
    grads = gather_full_grads(dist_layer)
    for name, p in serial.named_parameters():
        assert_close_rel(grads[name], p.grad, f"{where} grad of {name}", RTOL)


def _run(tp: int, cp: int) -> None:
    comm.init(tp=tp, cp=cp)
    for kind in ("mlp", "attn", "norm"):
        for num_tokens in (8, 7):  # 7: uneven over cp = 2 (4 + 3)
            _compare(kind, num_tokens, with_split=True)
    _compare("attn", 7, with_split=False)  # lengths exchanged instead of known


@pytest.mark.distributed
@pytest.mark.parametrize("tp,cp", [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_layers_match_serial(tp: int, cp: int) -> None:
    run_distributed(_run, tp * cp, tp, cp)


def _shard_shapes() -> None:
    comm.init(tp=4, cp=1)
    col = ColumnParallelLinear(DIM, 3 * DIM, blocks=3)
    row = RowParallelLinear(HIDDEN, DIM)
    # each rank allocates only its shard; the row-parallel bias is whole (added once)
    assert col.weight.shape == (3 * DIM // 4, DIM) and col.bias.shape == (3 * DIM // 4,)
    assert row.weight.shape == (DIM, HIDDEN // 4) and row.bias.shape == (DIM,)
    attn = DistributedAttention(DIM, HEADS)
    assert attn.num_heads == 1 and attn.qkv.weight.shape == (3 * DIM // 4, DIM)


@pytest.mark.distributed
def test_shards_are_local_sizes() -> None:
    run_distributed(_shard_shapes, 4)
