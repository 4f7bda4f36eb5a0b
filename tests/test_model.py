"""networks/vit.py: shapes, the closed-form parameter and FLOP counts, determinism."""

from __future__ import annotations

import pytest
import torch
from helpers import CONFIG_FILE
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from networks import build_model, training_flops
from networks.blocks import unpatchify
from networks.vit import (
    VisionTransformer,
    count_parameters,
    training_flops_per_sample,
    vit_from_params,
)
from utils.config import read_config

# (img_size, patch, embed, heads, depth)
SHAPES = [
    ((16, 32), 4, 32, 4, 2),      # the tiny config
    ((24, 24), 8, 48, 6, 1),      # square, 9 tokens
    ((8, 40), 4, 16, 2, 3),       # very wide
    ((40, 16), 8, 64, 8, 1),      # taller than wide
    ((64, 128), 8, 192, 8, 6),    # the CPU size
]


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("img, patch, embed, heads, depth", SHAPES)
def test_output_shape_equals_input_shape(img, patch, embed, heads, depth):
    torch.manual_seed(0)
    model = VisionTransformer(img, patch, 20, 20, embed, depth, heads).eval()
    x = torch.randn(2, 20, *img)
    with torch.no_grad():
        y = model(x)
    assert y.shape == x.shape
    assert y.dtype == torch.float32 and torch.isfinite(y).all()


def test_out_chans_sets_the_output_channels():
    torch.manual_seed(0)
    model = VisionTransformer((16, 32), 4, in_chans=5, out_chans=3, embed_dim=16, depth=1,
                              num_heads=2)
    assert model(torch.randn(1, 5, 16, 32)).shape == (1, 3, 16, 32)


def test_unpatchify_inverts_the_patch_layout():
    """Head output laid out as (patch row, patch col, pixel row, pixel col, channel) lands
    on the right pixel: token (i, j), pixel (a, b), channel c -> image (c, i*p+a, j*p+b)."""
    p, C, h, w = 4, 2, 2, 3
    img = torch.arange(C * 8 * 12, dtype=torch.float32).view(1, C, 8, 12)
    tokens = img.view(1, C, h, p, w, p).permute(0, 2, 4, 3, 5, 1).reshape(1, h * w, p * p * C)
    assert torch.equal(unpatchify(tokens, (h, w), p, C), img)
    # the AFNO's head keeps the token grid: (B, h, w, p p C)
    assert torch.equal(unpatchify(tokens.view(1, h, w, -1), (h, w), p, C), img)


@pytest.mark.parametrize("img, patch, embed, heads, depth", SHAPES)
@pytest.mark.parametrize("in_chans, out_chans, mlp_ratio", [(20, 20, 4.0), (3, 7, 2.0)])
def test_count_parameters_formula_equals_the_module(img, patch, embed, heads, depth, in_chans,
                                                    out_chans, mlp_ratio):
    model = VisionTransformer(img, patch, in_chans, out_chans, embed, depth, heads, mlp_ratio)
    tokens = (img[0] // patch) * (img[1] // patch)
    assert count_parameters(embed, depth, patch, in_chans, out_chans, tokens,
                            mlp_ratio) == n_params(model)


def test_training_flops_match_a_hand_count_for_a_small_config():
    # img 8x16, patch 4 -> N = 2 x 4 = 8 tokens; C_in = 2, C_out = 3, D = 8, hidden 32, depth 1
    patch = 2 * 8 * (2 * 4 * 4) * 8           # 4096
    qkv = 2 * 8 * 8 * 24                      # 3072
    proj = 2 * 8 * 8 * 8                      # 1024
    scores_and_av = 2 * (2 * 8 * 8 * 8)       # 2048
    mlp = 2 * (2 * 8 * 8 * 32)                # 8192
    head = 2 * 8 * 8 * (3 * 4 * 4)            # 6144
    forward = patch + qkv + proj + scores_and_av + mlp + head
    assert forward == 24576
    assert training_flops_per_sample((8, 16), 4, 2, 3, 8, 1) == 3 * forward == 73728


@pytest.mark.parametrize("img, patch, embed, heads, depth", [SHAPES[0], SHAPES[2],
                                                              SHAPES[4]])
def test_training_flops_are_three_times_torchs_forward_flop_count(img, patch, embed, heads,
                                                                   depth):
    """torch's FlopCounterMode counts the conv, the linears and attention of one forward
    pass per sample; the formula's training FLOPs are 3x that (backward = 2x forward).
    The math attention backend runs attention as counted bmm's (the fused CPU kernel is
    not counted by torch)."""
    model = VisionTransformer(img, patch, 20, 20, embed, depth, heads).eval()
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        model(torch.randn(1, 20, *img))
    assert training_flops_per_sample(img, patch, 20, 20, embed, depth) == \
        3 * counter.get_total_flops()


def test_the_configs_mlp_ratio_sizes_the_vit_and_its_flop_count_alike():
    """A ViT config's mlp_ratio is the model's: its MLP width, its parameter count and the
    FLOPs reported for MFU (3x torch's count of the built model's forward) all follow it."""
    tiny = read_config(CONFIG_FILE, "tiny", environ={})
    tokens = (tiny.img_size[0] // tiny.patch_size) * (tiny.img_size[1] // tiny.patch_size)
    sizes = set()
    for ratio in (2.0, 4.0):
        cfg = tiny.replace(mlp_ratio=ratio)
        model = build_model(cfg).eval()
        assert {b.mlp.fc1.out_features for b in model.blocks} == {int(cfg.embed_dim * ratio)}
        sizes.add(n_params(model))
        assert n_params(model) == count_parameters(cfg.embed_dim, cfg.depth, cfg.patch_size,
                                                   cfg.n_in_channels, cfg.n_out_channels,
                                                   tokens, ratio)
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
            model(torch.randn(1, cfg.n_in_channels, *cfg.img_size))
        assert training_flops(cfg) == 3 * counter.get_total_flops()
    assert len(sizes) == 2  # another ratio, another model (and checkpoints that do not fit)


def test_model_is_deterministic_given_the_seed():
    """The weights depend only on the `seed` argument, not on torch's global RNG."""
    def build(seed: int, global_seed: int) -> VisionTransformer:
        torch.manual_seed(global_seed)
        return VisionTransformer((16, 32), 4, 20, 20, 32, 2, 4, seed=seed)

    a, b, c = build(0, global_seed=0), build(0, global_seed=123), build(1, global_seed=0)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.pos_embed, c.pos_embed)
    assert not torch.equal(a.head.weight, c.head.weight)
    x = torch.randn(3, 20, 16, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
        assert not torch.equal(a(x), c(x))


def test_vit_from_params_uses_the_config_seed():
    params = read_config(CONFIG_FILE, "tiny", environ={}).replace(seed=3)
    a = vit_from_params(params)
    b = VisionTransformer((16, 32), 4, 20, 20, 32, 2, 4, seed=3)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name


def test_one_sample_output_does_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(0)
    model = VisionTransformer((16, 32), 4, 20, 20, 32, 2, 4).eval()
    x = torch.randn(4, 20, 16, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x)[1:2], model(x[1:2]), rtol=1e-5, atol=1e-5)
