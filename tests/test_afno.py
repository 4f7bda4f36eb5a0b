"""The AFNO forecaster (networks.afno): the serial model's shape, size, FLOPs, training and
truncation; then the spatially parallel model (token grid split over h x w, with and
without data parallelism) against the serial model on the same global batch: loss, every
parameter gradient, and every parameter after 3 Adam steps.

Training step under test (what train_mp.py will do with --h_parallel_size/--w_parallel_size):
    loss = l2_loss(model(tile of x), tile of y, layout.sum_over_grid)   # from tiles
    loss.backward()                 # DDP averages over dp during backward
    sync_shared_gradients(model)    # sums the partial (h, w) gradients of replicated weights
    optimizer.step()

Tolerances (fp32), per tensor, relative to the tensor's largest element, as for the ViT:
    loss and gradients              max |err| <= 1e-5 * max |serial|
    parameters after 3 Adam steps   max |err| <= 1e-5 * max |serial| + 1e-5
The tiles run the same 1D FFTs, matmuls and sums as the serial model, in other orders and
batch shapes (round-off ~1e-7 relative). Adam divides by sqrt(v), which amplifies that noise
on near-zero gradients up to lr = 1e-3 per step, hence the absolute term: 1% of lr.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    CONFIG_FILE,
    assert_trains_like_serial,
    kept_rows,
    layout_of,
    run_distributed,
)
from sharded import gather_full_state_dict, load_serial_state_dict, scatter_image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.flop_counter import FlopCounterMode

from distributed import comm
from distributed.helpers import annotation_errors
from distributed.spatial import SpatialLayers
from networks import build_model, training_flops
from networks.afno import (
    AFNONet,
    SerialGrid,
    afno_from_params,
    count_parameters,
    flops_per_sample,
    training_flops_per_sample,
)
from networks.loss import l2_loss
from networks.vit import VisionTransformer
from utils.config import load_yaml, read_config

RTOL, ATOL_ADAM, STEPS, GLOBAL_BATCH, LR = 1e-5, 1e-5, 3, 4, 1e-3
# 28 x 36 pixels, patch 4: a 7 x 9 token grid, uneven over 2 ranks both ways
IMG = (28, 36)
TINY = dict(img_size=IMG, patch_size=4, in_chans=3, out_chans=2, embed_dim=16, depth=2,
            num_blocks=4)


def _params(**overrides) -> SimpleNamespace:
    base = dict(img_size=list(IMG), patch_size=4, n_in_channels=3, n_out_channels=2,
                embed_dim=16, depth=2, num_blocks=4, mlp_ratio=4.0, sparsity_threshold=0.01,
                hard_thresholding_fraction=1.0, seed=0, activation_checkpointing="none",
                ensemble_size=1, afno_variant="default")
    return SimpleNamespace(**{**base, **overrides})


# ------------------------------------------------------------------------- serial model

def test_forecast_has_the_input_grid_and_out_chans() -> None:
    model = AFNONet(**TINY)
    assert model(torch.randn(3, 3, *IMG)).shape == (3, 2, *IMG)
    with pytest.raises(ValueError, match=r"input tile \(28, 32\) != \(28, 36\)"):
        model(torch.randn(1, 3, 28, 32))


@pytest.mark.parametrize("kw", [TINY, dict(TINY, embed_dim=24, num_blocks=3, depth=3),
                                dict(TINY, img_size=(64, 128), patch_size=8, embed_dim=32,
                                     num_blocks=8, mlp_ratio=2.0, hidden_size_factor=2)])
def test_parameter_count_matches_the_closed_form(kw: dict) -> None:
    model = AFNONet(**kw)
    grid = (kw["img_size"][0] // kw["patch_size"], kw["img_size"][1] // kw["patch_size"])
    expected = count_parameters(kw["embed_dim"], kw["depth"], kw["patch_size"], kw["in_chans"],
                                kw["out_chans"], grid, kw["num_blocks"],
                                kw.get("mlp_ratio", 4.0), kw.get("hidden_size_factor", 1))
    assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_flop_count_matches_torch_flop_counter_apart_from_the_ffts(fraction: float) -> None:
    """torch's counter sees every matmul and convolution but not the FFTs: the analytic
    count without its FFT term must equal it exactly (forward, per sample)."""
    model = AFNONet(**TINY, hard_thresholding_fraction=fraction)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.randn(2, 3, *IMG))
    parts = flops_per_sample(IMG, 4, 3, 2, 16, 2, 4, hard_thresholding_fraction=fraction)
    assert counter.get_total_flops() / 2 == sum(parts.values()) - parts["fft"]
    total = training_flops_per_sample(IMG, 4, 3, 2, 16, 2, 4,
                                      hard_thresholding_fraction=fraction)
    assert total == 3 * sum(parts.values())
    assert 0 < parts["fft"] < 0.5 * total  # small next to the matmuls, but there


def test_a_few_adam_steps_reduce_the_loss_on_a_fixed_batch() -> None:
    """A learnable map (smooth fields -> the same fields shifted east by one patch): the
    relative L2 loss falls by a quarter within 8 steps."""
    torch.manual_seed(0)
    model = AFNONet(**TINY, hard_thresholding_fraction=0.5)
    x = F.interpolate(torch.randn(4, 3, 7, 9), size=IMG, mode="bilinear")
    y = torch.roll(x[:, :2], 4, dims=-1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = l2_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.75 * losses[0], losses


def test_truncation_zeroes_the_high_modes_of_the_filter_output() -> None:
    """The filter adds irfft2(spectrum on the kept modes) to its input: the spectrum of
    (output - input) must vanish outside the kept rows and columns, up to the fp32
    round-off of subtracting the input back (~1e-7 of |u| ~ 1, so 1e-5 of the kept modes,
    which larger weights make O(1))."""
    model = AFNONet(**TINY, hard_thresholding_fraction=0.5, sparsity_threshold=0.0)
    filt = model.blocks[0].filter
    u = torch.randn(2, 7, 9, 16)
    with torch.no_grad():
        for p in filt.parameters():
            p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(0))
        spec = torch.fft.rfft2(filt(u) - u, dim=(1, 2), norm="ortho").abs()
    modes = filt.transform.modes  # kh 2 of 7 rows (0, 1, 6), kw 2 of 5 columns
    kept = torch.zeros(7, 5, dtype=torch.bool)
    kept[torch.tensor(kept_rows(modes))[:, None], torch.arange(modes.kw)] = True
    assert kept_rows(modes) == [0, 1, 6] and modes.kw == 2
    assert spec[:, kept].max() > 0.1
    assert spec[:, ~kept].max() < 1e-5 * spec[:, kept].max()


def test_the_model_factory_builds_the_configs_network_serial_by_default() -> None:
    """networks.build_model reads `model` and nothing else: no process group decides the
    layout (a spatial layout is passed in, as train_mp.py does). Bad AFNO settings are the
    config schema's one-line errors (tests/test_config_schema.py)."""
    comm.reset()
    afno = read_config(CONFIG_FILE, "tiny_afno", environ={})
    model = build_model(afno)
    assert isinstance(model, AFNONet) and isinstance(model.layer_factory, SerialGrid)
    assert isinstance(build_model(read_config(CONFIG_FILE, "tiny", environ={})),
                      VisionTransformer)


# ------------------------------------------------------------------------- configs

def test_cpu_afno_config_is_a_4_05_M_parameter_3_13_GFLOP_model() -> None:
    comm.reset()
    p = read_config(CONFIG_FILE, "cpu_afno", environ={})
    assert (p.model, p.img_size, p.patch_size, p.embed_dim, p.depth, p.num_blocks) == \
        ("afno", [64, 128], 8, 256, 6, 8)
    model = afno_from_params(p)
    assert model.grid == (8, 16)
    n = sum(q.numel() for q in model.parameters())
    assert n == count_parameters(256, 6, 8, 20, 20, (8, 16), 8) == 4_052_480
    flops = training_flops_per_sample((64, 128), 8, 20, 20, 256, 6, 8)
    assert round(flops / 1e9, 2) == 3.13


def test_the_full_size_afno_is_a_65_4_M_parameter_1_53_TFLOP_model() -> None:
    """The sizes docs/spatial_parallelism.md gives (counted by formula: no 65 M model is
    built here)."""
    p = read_config(CONFIG_FILE, "afno", environ={})
    n = count_parameters(p.embed_dim, p.depth, p.patch_size, p.n_in_channels,
                         p.n_out_channels, (45, 90), p.num_blocks, p.mlp_ratio)
    assert round(n / 1e6, 1) == 65.4
    assert round(training_flops(p) / 1e12, 2) == 1.53


def test_afno_sections_are_afno_models_and_vit_sections_stay_vit() -> None:
    sections = load_yaml(CONFIG_FILE)  # merge keys resolved
    for name, section in sections.items():
        assert section["model"] == ("afno" if "afno" in name else "vit"), name
        assert (section["h_parallel_size"], section["w_parallel_size"]) == (1, 1), name
        if section["model"] == "afno":
            read_config(CONFIG_FILE, name, environ={})  # the schema's checks across keys
    tiny = read_config(CONFIG_FILE, "tiny_afno", environ={})
    assert sum(q.numel() for q in afno_from_params(tiny).parameters()) < 100_000


def test_afno_bsN_opt_sections_follow_the_vits_sqrt_lr_scaling() -> None:
    sections = load_yaml(CONFIG_FILE)
    for n in (16, 32, 64, 128, 256, 512, 1024, 2048):
        vit = sections[f"cpu_bs{n}_opt"]
        for name in (f"afno_bs{n}_opt", f"cpu_afno_bs{n}_opt"):
            p = sections[name]
            assert (p["global_batch_size"], p["lr"], p["amp_mode"] != "none") == \
                (vit["global_batch_size"], vit["lr"], True), name


# ------------------------------------------------------------------ spatially parallel

def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(GLOBAL_BATCH, 3, *IMG, generator=g),
            torch.randn(GLOBAL_BATCH, 3, *IMG, generator=g))


def _compare(fraction: float) -> None:
    # a config forecasts the channels it reads (the schema refuses n_out != n_in)
    serial = AFNONet(**{**TINY, "out_chans": 3}, hard_thresholding_fraction=fraction, seed=3)
    cfg = read_config(CONFIG_FILE, "tiny_afno", environ={}).replace(
        img_size=list(IMG), n_in_channels=3, n_out_channels=3, embed_dim=16, depth=2,
        num_blocks=4, hard_thresholding_fraction=fraction, seed=3,
        h_parallel_size=comm.get_size("h"), w_parallel_size=comm.get_size("w"))
    spatial = layout_of(cfg)  # the layout train_mp.py builds: its layers, its sums over tiles
    assert spatial.kind == "spatial" and spatial.tile.grid == IMG
    model = build_model(cfg, layers=spatial.layers)
    for name, value in gather_full_state_dict(model).items():  # the serial initialisation
        assert torch.equal(value, serial.state_dict()[name]), f"{name} initialised differently"
    if comm.get_size("dp") > 1:
        model = DistributedDataParallel(model, process_group=comm.get_group("dp"))
    dp, dp_rank = comm.get_size("dp"), comm.get_rank("dp")
    local = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    layout = f"h={comm.get_size('h')} w={comm.get_size('w')} dp={dp} fraction={fraction}"
    tile = lambda t: scatter_image(t[local], serial.grid, 4)  # noqa: E731
    assert_trains_like_serial(
        serial, model, [_batch(step) for step in range(STEPS)],
        lambda m, x, y: l2_loss(m(x), y),
        lambda m, x, y: l2_loss(m(tile(x)), tile(y), spatial.sum_over_grid),
        layout, LR, RTOL, ATOL_ADAM)


def _run(h: int, w: int) -> None:
    comm.init(h=h, w=w)
    for fraction in (1.0, 0.6):  # 0.6: 5 of 7 rows and 3 of 5 columns kept
        _compare(fraction)


@pytest.mark.distributed
@pytest.mark.parametrize("h,w,world", [(2, 2, 4), (2, 1, 4), (1, 2, 2)],
                         ids=["h2xw2", "dp2xh2", "w2"])
def test_spatial_model_matches_serial(h: int, w: int, world: int) -> None:
    run_distributed(_run, world, h, w)


def _annotations_and_checkpoints() -> None:
    comm.init(h=2, w=2)
    model = afno_from_params(_params(), layers=SpatialLayers())
    assert annotation_errors(model) == []  # every parameter sharded or shared, tp cp h w
    # pos_embed holds this rank's tile only (7 x 9 tokens -> 4 or 3 rows, 5 or 4 columns)
    rows, cols = (4, 3)[comm.get_rank("h")], (5, 4)[comm.get_rank("w")]
    assert model.pos_embed.shape == (1, rows, cols, 16)
    assert model.pos_embed.sharded_dims_mp == [None, "h", "w", None]
    # a checkpoint is layout free: the full state dict loads back into the tiles exactly
    serial = AFNONet(**TINY, seed=5)
    load_serial_state_dict(model, serial.state_dict())
    full = gather_full_state_dict(model)
    assert all(torch.equal(full[k], v) for k, v in serial.state_dict().items())


@pytest.mark.distributed
def test_tiles_hold_their_pos_embed_and_checkpoints_are_layout_free() -> None:
    run_distributed(_annotations_and_checkpoints, 4)
