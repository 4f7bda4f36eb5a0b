"""The whole ViT with tensor, context and data parallelism against the serial ViT on the same
global batch: loss, every parameter gradient, and every parameter after 3 Adam steps.

Training step under test (what train_mp.py does):
    loss.backward()                 # DDP averages gradients over dp during backward
    sync_shared_gradients(model)    # then sum the partial (cp) gradients of shared weights
    optimizer.step()
The two reductions commute (a mean over dp and a sum over cp are both linear), so running the
model-parallel one after DDP's is exact; the dp x tp and dp x cp cases check it.

Tolerances (fp32), per tensor, relative to the tensor's largest element:
    loss and gradients              max |err| <= 1e-5 * max |serial|
    parameters after 3 Adam steps   max |err| <= 1e-5 * max |serial| + 1e-5
Adam divides by sqrt(v), which amplifies the ~1e-7 summation-order noise of near-zero
gradients (up to lr = 1e-3 per step in the worst case), hence the absolute term: 1% of lr.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import CONFIG_FILE, assert_trains_like_serial, layout_of, run_distributed
from sharded import gather_full_state_dict, load_serial_state_dict
from torch.nn.parallel import DistributedDataParallel

from distributed import comm
from distributed.helpers import annotation_errors, sync_shared_gradients
from distributed.layers import DistributedLayers
from networks.vit import VisionTransformer, vit_from_params
from utils.config import read_config

RTOL, ATOL_ADAM, STEPS, GLOBAL_BATCH, LR = 1e-5, 1e-5, 3, 4, 1e-3
TINY = dict(patch_size=4, in_chans=3, out_chans=2, embed_dim=32, depth=2, num_heads=4)
IMAGES = [(16, 32), (12, 28)]  # 32 tokens, and 21 tokens (uneven over cp = 2: 11 + 10)


def _batch(step: int, img: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(GLOBAL_BATCH, TINY["in_chans"], *img, generator=g),
            torch.randn(GLOBAL_BATCH, TINY["out_chans"], *img, generator=g))


def _compare(img: tuple[int, int]) -> None:
    torch.manual_seed(0)
    serial = VisionTransformer(img_size=img, **TINY)
    model = VisionTransformer(img_size=img, layers=DistributedLayers(), **TINY)
    load_serial_state_dict(model, serial.state_dict())
    for name, value in gather_full_state_dict(model).items():  # exact round trip
        assert torch.equal(value, serial.state_dict()[name]), name
    if comm.get_size("dp") > 1:
        model = DistributedDataParallel(model, process_group=comm.get_group("dp"))
    dp, dp_rank = comm.get_size("dp"), comm.get_rank("dp")
    local = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    layout = f"tp={comm.get_size('tp')} cp={comm.get_size('cp')} dp={dp} img={img}"
    assert_trains_like_serial(
        serial, model, [_batch(step, img) for step in range(STEPS)],
        lambda m, x, y: F.mse_loss(m(x), y), lambda m, x, y: F.mse_loss(m(x[local]), y[local]),
        layout, LR, RTOL, ATOL_ADAM)


def _run(tp: int, cp: int) -> None:
    comm.init(tp=tp, cp=cp)
    for img in IMAGES:
        _compare(img)


@pytest.mark.distributed
@pytest.mark.parametrize("tp,cp,world", [(2, 1, 2), (1, 2, 2), (2, 2, 4), (2, 1, 4), (1, 2, 4)],
                         ids=["tp2", "cp2", "tp2xcp2", "dp2xtp2", "dp2xcp2"])
def test_matches_serial(tp: int, cp: int, world: int) -> None:
    run_distributed(_run, world, tp, cp)


def _annotations() -> None:
    comm.init(tp=2, cp=2)
    torch.manual_seed(0)
    serial = VisionTransformer(img_size=(16, 32), **{**TINY, "out_chans": 3})
    cfg = read_config(CONFIG_FILE, "tiny", environ={}).replace(
        n_in_channels=3, n_out_channels=3, tp=2, cp=2)  # a config forecasts what it reads
    model = vit_from_params(cfg, layers=layout_of(cfg).layers)  # what train_mp.py builds
    # every parameter is annotated: sharded over some groups, replicated over the others
    assert annotation_errors(model) == []
    # memory: each tp rank holds 1/tp of every sharded weight, never the full layer
    full = dict(serial.named_parameters())
    for name, p in model.named_parameters():
        divisor = 2 if "tp" in p.sharded_dims_mp else 1
        assert p.numel() * divisor == full[name].numel(), name
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in full.values())
    # an unannotated parameter is refused, not silently left with a partial gradient
    model.blocks[0].extra = nn.Linear(4, 4)
    assert any("blocks.0.extra.weight: not annotated" in e for e in annotation_errors(model))
    with pytest.raises(RuntimeError, match="blocks.0.extra.weight: not annotated"):
        sync_shared_gradients(model)


@pytest.mark.distributed
def test_every_parameter_is_sharded_or_shared() -> None:
    run_distributed(_annotations, 4)


def test_serial_model_needs_no_reduction() -> None:
    comm.reset()  # one process: the serial layers, no annotations, nothing to reduce
    model = VisionTransformer(img_size=(16, 32), **TINY)
    F.mse_loss(model(torch.randn(1, 3, 16, 32)), torch.zeros(1, 2, 16, 32)).backward()
    before = [p.grad.clone() for p in model.parameters()]
    sync_shared_gradients(model)
    assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters(), strict=True))


def _init_matches_serial() -> None:
    serial = VisionTransformer(img_size=IMAGES[0], seed=7, **TINY)
    model = VisionTransformer(img_size=IMAGES[0], layers=DistributedLayers(), seed=7, **TINY)
    full = gather_full_state_dict(model)
    for name, tensor in serial.state_dict().items():
        assert torch.equal(full[name], tensor), f"{name} initialised differently"


@pytest.mark.distributed
@pytest.mark.parametrize("tp, cp", [(2, 1), (1, 2), (2, 2)])
def test_initialisation_is_the_serial_one_on_any_layout(tp: int, cp: int) -> None:
    """train_mp.py with any tp/cp starts from exactly train.py's weights (same seed)."""
    run_distributed(lambda: (comm.init(tp=tp, cp=cp), _init_matches_serial()), tp * cp)
