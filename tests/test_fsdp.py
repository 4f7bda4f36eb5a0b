"""FSDP2 (`--fsdp`, distributed/fsdp.py): the model sharded over the data-parallel ranks in
place of DDP's replicas, on every layout.

In one process per rank (real gloo groups), the model and optimizer train.py and
train_mp.py build (`training.run.wrap_model`, the layout's own layers and loss):
  - FSDP over dp 2 alone, and with tp 2, cp 2 (ViT) or h 2 (AFNO) on 4 ranks, trains like
    the serial model: loss, every gathered gradient, every parameter after 3 Adam steps
    (the tolerances of tests/test_model_parallel_vit.py); every parameter, its gradient and
    Adam's moments hold 1/dp of the rank's tensor, split along the dim that leaves the
    least padding (`pos_embed`, (1, N, D), not along its dim of one);
  - the checkpoint mapping (`Layout.full_tensor` / `local_tensor`) gives the serial tensors
    and cuts them back into this rank's FSDP slices, bit for bit;
  - validation with a different number of batches on each dp rank (`Layout.evaluating`)
    gives the unsharded model's outputs and leaves the model sharded as it was.
In this process, on the fake backend (planning/fake_world.py): FSDP2's own set-up accepts
the dim `shard_dim` picks for every parameter of the tutorial's models, in the layouts the
tutorial publishes, at dp 2, 3, 12, 64 and 1,024 (FSDP2 refuses an uneven split of any dim
but the first), and no parameter is padded where dp divides one of its dims. The dry run
builds them (tests/test_dry_run.py).
End to end (train.py and train_mp.py under torchrun, resume across FSDP and DDP, fp16
with an overflow, the graphs script's refusal): tests/test_memory_runs.py.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import CONFIG_FILE, assert_trains_like_serial, layout_of, run_distributed
from sharded import scatter_image
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from distributed import comm
from distributed.fsdp import mesh_of, shard_dim, shard_model
from distributed.layout import Layout
from networks import build_model
from networks.loss import l2_loss
from planning.fake_world import fake_world
from training.run import build_optimizer, wrap_model
from utils.config import load_yaml, read_config
from utils.config_schema import Config, validate
from utils.parallel_axes import config_sizes, mp_ens_size

RTOL, ATOL_ADAM, STEPS, BATCH, LR = 1e-5, 1e-5, 3, 4, 1e-3
SHAPES = {"vit": ("tiny", dict(img_size=[12, 28], patch_size=4, embed_dim=32, depth=2,
                                num_heads=4)),
          "afno": ("tiny_afno", dict(img_size=[28, 36], patch_size=4, embed_dim=16, depth=2,
                                     num_blocks=4))}
LAYOUTS = {"dp2": ("vit", {}, 2), "dp2xtp2": ("vit", {"tp": 2}, 4),
           "dp2xcp2": ("vit", {"cp": 2}, 4), "dp2xh2": ("afno", {"h_parallel_size": 2}, 4),
           # each block's gathered parameters kept from its forward to its backward
           "dp2xtp2-no-reshard": ("vit", {"tp": 2, "no_reshard_after_forward": True}, 4),
           # FSDP's gathers inside the recompute of a context-parallel block
           "dp2xcp2-recompute": ("vit", {"cp": 2, "activation_checkpointing": "blocks"}, 4),
           # the spectral weights (2, blocks, ...) split along a dim after their first
           "dp4-afno": ("afno", {}, 4)}
# The tutorial's models (config/ViT.yaml: every other section is one of these with another
# schedule or batch, or a CPU-sized mirror), alone and in the layouts the tutorial runs
# them in (docs/scaling.md)
TUTORIAL_LAYOUTS = {"base": ("base", {}), "mp": ("mp", {}), "mp-tp4": ("mp", {"tp": 4}),
                    "mp_patch4": ("mp_patch4", {}),
                    "mp_patch4-tp4xcp4": ("mp_patch4", {"tp": 4, "cp": 4}),
                    "afno": ("afno", {}), "afno-h4": ("afno", {"h_parallel_size": 4}),
                    "ens": ("ens", {})}
DATA_PARALLEL = (2, 3, 12, 64, 1024)


def _config(model: str, sizes: dict[str, int], **more) -> Config:
    section, shape = SHAPES[model]
    return read_config(CONFIG_FILE, section, environ={}).replace(
        n_in_channels=3, n_out_channels=3, seed=5, fsdp=True, **shape, **sizes, **more)


def _join(cfg: Config):
    comm.init(tp=cfg.tp, cp=cfg.cp, h=cfg.h_parallel_size, w=cfg.w_parallel_size)
    layout = layout_of(cfg)
    assert layout.fsdp
    return layout


def _batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    return (torch.randn(BATCH, 3, *cfg.img_size, generator=g),
            torch.randn(BATCH, 3, *cfg.img_size, generator=g))


def _mine(cfg: Config, layout, t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a global batch: its dp shard of the samples, its tile."""
    dp, rank = comm.get_size("dp"), comm.get_rank("dp")
    t = t[rank * BATCH // dp:(rank + 1) * BATCH // dp]
    if layout.tile.is_whole:
        return t
    return scatter_image(t, tuple(n // cfg.patch_size for n in cfg.img_size), cfg.patch_size)


def _trains_like_serial(name: str) -> None:
    model_name, sizes, _ = LAYOUTS[name]
    cfg = _config(model_name, sizes)
    layout = _join(cfg)
    serial = build_model(cfg.replace(fsdp=False, tp=1, cp=1, h_parallel_size=1))
    model = wrap_model(build_model(cfg, layers=layout.layers), cfg, layout)
    whole = {n: p.shape for n, p in build_model(cfg, layers=layout.layers).named_parameters()}
    dp = comm.get_size("dp")
    for n, p in model.named_parameters():  # 1/dp of this rank's tensor, rounded up
        assert isinstance(p, DTensor) and p.shape == whole[n], n
        d = p.placements[0].dim  # fsdp.shard_dim: the dim with the least padding
        assert d == shard_dim(whole[n], dp) and p.to_local().shape[d] <= -(-whole[n][d] // dp)
    # pos_embed (1, N, D) is split along N or D, not along its dim of one: no rank holds
    # it whole (as each would, padded, with dim 0)
    assert model.pos_embed.placements[0].dim > 0 and \
        model.pos_embed.to_local().numel() * dp <= 2 * model.pos_embed.numel()
    assert_trains_like_serial(
        serial, model, [_batch(cfg, s) for s in range(STEPS)],
        lambda m, x, y: l2_loss(m(x), y),
        lambda m, x, y: l2_loss(m(_mine(cfg, layout, x)), _mine(cfg, layout, y),
                            layout.sum_over_grid),
        f"FSDP {name}", LR, RTOL, ATOL_ADAM)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fsdp_trains_like_serial_on_every_layout(name: str) -> None:
    run_distributed(_trains_like_serial, LAYOUTS[name][2], name, timeout=180)


def _checkpoint_mapping() -> None:
    cfg = _config("vit", {"tp": 2})
    layout = _join(cfg)
    serial = dict(build_model(cfg.replace(fsdp=False, tp=1)).named_parameters())
    model = wrap_model(build_model(cfg, layers=layout.layers), cfg, layout)
    optimizer = build_optimizer(cfg, model)
    x, y = _batch(cfg, 0)
    l2_loss(model(_mine(cfg, layout, x)), _mine(cfg, layout, y)).backward()
    layout.after_backward(model)
    optimizer.step()
    for name, p in model.named_parameters():
        full = layout.full_tensor(p.detach(), p)
        assert full.shape == serial[name].shape and not isinstance(full, DTensor), name
        back = layout.local_tensor(full, p)
        assert isinstance(back, DTensor) and back.placements == p.placements, name
        assert torch.equal(back.to_local(), p.detach().to_local()), name
        for key, moment in optimizer.state[p].items():
            if moment.dim() > 0:
                again = layout.local_tensor(layout.full_tensor(moment, p), p)
                assert torch.equal(again.to_local(), moment.to_local()), (name, key)


@pytest.mark.distributed
def test_checkpoint_tensors_are_the_serial_ones_and_cut_back_bitwise() -> None:
    run_distributed(_checkpoint_mapping, 4, timeout=120)


def _validation_with_uneven_batches() -> None:
    cfg = _config("vit", {})
    layout = _join(cfg)
    plain = build_model(cfg.replace(fsdp=False))
    model = wrap_model(build_model(cfg), cfg, layout)
    batches = 3 if comm.get_rank("dp") == 0 else 1  # a sharded forward would wait forever
    model.eval()
    with torch.no_grad(), layout.evaluating(model):
        for step in range(batches):
            x, _ = _batch(cfg, step)
            assert torch.equal(model(x), plain(x)), step
    model.train()
    for p in model.parameters():  # sharded again, and training goes on
        assert p.to_local().shape[0] < p.shape[0] or p.shape[0] == 1
    x, y = _batch(cfg, 0)
    l2_loss(model(_mine(cfg, layout, x)), _mine(cfg, layout, y)).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.distributed
def test_validation_runs_a_different_number_of_batches_on_each_rank() -> None:
    run_distributed(_validation_with_uneven_batches, 2, timeout=120)


def _tutorial_parameters() -> dict[torch.Size, str]:
    """Each shape of a parameter that one rank of a tutorial layout holds (its tp shard or
    its tile's copy: what FSDP shards over dp), with the first layout and name it has."""
    shapes: dict[torch.Size, str] = {}
    sections = load_yaml(CONFIG_FILE)  # parsed once: the YAML parser takes most of a read
    for name, (section, sizes) in TUTORIAL_LAYOUTS.items():
        cfg = validate({**sections[section], **sizes}, f"config '{section}'")
        ranks = mp_ens_size(config_sizes(cfg))  # one process alone is the serial layout
        with fake_world(ranks, collectives=False) if ranks > 1 else contextlib.nullcontext():
            comm.init(cfg.parallel_order, **config_sizes(cfg))
            layout = Layout.of_groups(cfg, None, torch.device("cpu"))
            with torch.device("meta"):
                model = build_model(cfg, layers=layout.layers)
            for n, p in model.named_parameters():
                shapes.setdefault(p.shape, f"{name} {n}")
        comm.reset()
    return shapes


class _Parameters(nn.Module):
    """A parameter of each shape, as the root of a model with no blocks (`shard_model`)."""

    def __init__(self, shapes: list[torch.Size]):
        super().__init__()
        self.blocks = nn.ModuleList()
        self.params = nn.ParameterList(nn.Parameter(torch.empty(s, device="meta"))
                                       for s in shapes)


def test_fsdp2_shards_every_tutorial_parameter_at_any_data_parallel_size() -> None:
    tutorial = _tutorial_parameters()
    mp_pos_embed = torch.Size([1, 4050, 1024])  # mp's (1, N, D): 45 x 90 tokens of 1,024
    assert tutorial[mp_pos_embed] == "mp pos_embed"
    for dp in DATA_PARALLEL:
        with fake_world(dp, rank=dp - 1, collectives=False):  # the last rank: the padding
            model = _Parameters(list(tutorial))
            # FSDP2's own checks run here: an uneven split of a dim after the first raises
            shard_model(model, mesh_of(dist.group.WORLD, torch.device("cpu")))
            assert isinstance(model, FSDPModule)
            sharded = model._get_fsdp_state()._fsdp_param_group.fsdp_params
            assert sorted(map(tuple, (f._orig_size for f in sharded))) == \
                sorted(map(tuple, tutorial))
            for f in sharded:
                shape, dim = f._orig_size, f.fsdp_placement.dim
                where = (tutorial[shape], tuple(shape), dp)
                assert dim == shard_dim(shape, dp) and (dim == 0 or shape[dim] % dp == 0), where
                gathered = f.padded_sharded_param_size.numel() * dp  # FSDP2's padded slices
                if any(n % dp == 0 for n in shape):  # no padding where dp divides a dim
                    assert gathered == math.prod(shape), where
                if shape == mp_pos_embed and dp == 1024:  # the root gathers D / 1,024 each
                    assert f.padded_sharded_param_size == (1, 4050, 1)
