"""Activation checkpointing (`activation_checkpointing: blocks`, networks/blocks.py): each
block keeps only its input and recomputes its activations in backward.

Proven on the serial ViT and AFNO, the ViT with tp 2 and cp 2, and the AFNO on an h 2 x w 2
mesh (uneven tiles), for two steps each:
  - the recomputing model and the same model without recompute, on the same layout, give
    the same loss and the same gradients *bit for bit*: the recomputed forward runs the
    block's collectives (tp all-reduces, the cp all-gather of k and v, the mesh's
    all-to-alls) again and they return exactly what they returned in the forward;
  - the recomputing model trains like the serial model without recompute: loss, every
    gathered gradient, every parameter after 3 Adam steps (tolerances of
    tests/test_model_parallel_vit.py: 1e-5 relative, + 1e-5 absolute after Adam);
  - it keeps less for backward: the tensors saved outside the blocks' recompute regions
    are fewer bytes than without (the blocks' activations are what checkpointing drops).
torch.compile with recompute is tested end to end (tests/test_memory_runs.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import CONFIG_FILE, assert_trains_like_serial, layout_of, run_distributed
from sharded import scatter_image

from distributed import comm
from distributed.helpers import sync_shared_gradients
from distributed.layout import Layout
from networks import build_model
from networks.loss import l2_loss
from utils.config import read_config
from utils.config_schema import Config

RTOL, ATOL_ADAM, STEPS, BATCH, LR = 1e-5, 1e-5, 3, 4, 1e-3
# The ViT on 21 tokens (uneven over cp 2); the AFNO on a 7 x 9 token grid (uneven tiles).
SHAPES = {"vit": ("tiny", dict(img_size=[12, 28], patch_size=4, embed_dim=32, depth=2,
                                num_heads=4)),
          "afno": ("tiny_afno", dict(img_size=[28, 36], patch_size=4, embed_dim=16, depth=2,
                                     num_blocks=4))}


def _config(model: str, recompute: str, sizes: dict[str, int]) -> Config:
    section, shape = SHAPES[model]
    return read_config(CONFIG_FILE, section, environ={}).replace(
        n_in_channels=3, n_out_channels=3, seed=5, activation_checkpointing=recompute,
        **shape, **sizes)


def _batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return (torch.randn(BATCH, 3, *cfg.img_size, generator=g),
            torch.randn(BATCH, 3, *cfg.img_size, generator=g))


def _loss(cfg: Config, layout: Layout):
    """The relative L2 loss of this rank's tile (the whole grid but on a mesh), its sums
    completed over the tiles as the layout says: what training computes."""
    grid = tuple(n // cfg.patch_size for n in cfg.img_size)
    if layout.tile.is_whole:
        return lambda m, x, y: l2_loss(m(x), y)
    tile = lambda t: scatter_image(t, grid, cfg.patch_size)  # noqa: E731
    return lambda m, x, y: l2_loss(m(tile(x)), tile(y), layout.sum_over_grid)


def _saved_bytes(model: torch.nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for backward outside recompute regions."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model, x, y)
    return sum(seen.values())


def _compare(model: str, sizes: dict[str, int]) -> None:
    cfg = _config(model, "blocks", sizes)
    layout = layout_of(cfg)  # the layout train_mp.py builds: its layers, its sums over tiles
    serial = build_model(_config(model, "none", {}))
    recomputing = build_model(cfg, layers=layout.layers)
    plain = build_model(cfg.replace(activation_checkpointing="none"), layers=layout.layers)
    loss_fn = _loss(cfg, layout)
    what = f"{model} recomputing blocks, {sizes or 'serial'}"
    for step in range(2):  # bit for bit against the same layout without recompute
        x, y = _batch(cfg, step)
        losses = []
        for m in (recomputing, plain):
            m.zero_grad()
            loss = loss_fn(m, x, y)
            loss.backward()
            sync_shared_gradients(m)
            losses.append(loss.detach())
        assert torch.equal(*losses), f"{what}: loss {losses[0]} != {losses[1]}"
        for (name, a), b in zip(recomputing.named_parameters(), plain.parameters(),
                                strict=True):
            assert torch.equal(a.grad, b.grad), f"{what}: gradient of {name} differs"
    x, y = _batch(cfg, 0)
    kept, all_kept = _saved_bytes(recomputing, loss_fn, x, y), _saved_bytes(plain, loss_fn, x, y)
    assert kept < 0.7 * all_kept, f"{what}: keeps {kept} bytes for backward of {all_kept}"
    if not layout.is_model_parallel:
        return  # `plain` is the serial model: bitwise its gradients is training like it
    recomputing.zero_grad()
    assert_trains_like_serial(serial, recomputing, [_batch(cfg, s) for s in range(STEPS)],
                              lambda m, x, y: l2_loss(m(x), y), loss_fn, what, LR, RTOL,
                              ATOL_ADAM)


@pytest.mark.parametrize("model", ["vit", "afno"])
def test_serial_recompute_is_bitwise_the_plain_model_and_keeps_less(model: str) -> None:
    comm.reset()
    _compare(model, {})


@pytest.mark.distributed
@pytest.mark.parametrize("model, sizes", [("vit", {"tp": 2}), ("vit", {"cp": 2}),
                                          ("afno", {"h_parallel_size": 2,
                                                    "w_parallel_size": 2})],
                         ids=["tp2", "cp2", "h2xw2"])
def test_recompute_reruns_the_collectives_exactly_and_trains_like_serial(model, sizes) -> None:
    def run() -> None:
        cfg = _config(model, "blocks", sizes)
        comm.init(tp=cfg.tp, cp=cfg.cp, h=cfg.h_parallel_size, w=cfg.w_parallel_size)
        _compare(model, sizes)

    run_distributed(run, 4 if model == "afno" else 2)
