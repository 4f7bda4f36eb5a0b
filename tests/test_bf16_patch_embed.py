"""The ViT under CPU bf16 autocast stays within bf16 rounding of fp32.

Regression test for a oneDNN AMX bf16 convolution that returns wrong outputs for the patch
embedding's shape (kernel = stride = 8, 20 input channels) with torch 2.13 on Sapphire
Rapids CPUs: relative error ~1.3 instead of ~3e-3. networks/vit.py runs that convolution in
as a bf16 matmul under CPU autocast. On CPUs without AMX the test passes either way.
"""

from __future__ import annotations

import torch

from networks.vit import PatchEmbed, VisionTransformer

BF16_RTOL = 2e-2  # bf16 keeps 8 bits of mantissa: ~3e-3 per op, a few ops deep


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_patch_embedding_under_bf16_autocast_matches_fp32():
    torch.manual_seed(0)
    embed = PatchEmbed((64, 128), 8, 20, 192)
    x = torch.randn(2, 20, 64, 128)
    with torch.no_grad():
        reference = embed(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = embed(x)
    assert got.shape == reference.shape == (2, 128, 192)
    assert relative_error(got, reference) < BF16_RTOL


def test_the_model_under_bf16_autocast_matches_fp32():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=(64, 128), patch_size=8, embed_dim=64, depth=2,
                              num_heads=4).eval()
    x = torch.randn(2, 20, 64, 128)
    with torch.no_grad():
        reference = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(x)
    assert relative_error(got, reference) < BF16_RTOL
