"""bench.bench_step runs end to end (no timing assertions), and the CPU precision policy
of utils.precision.attention (serial and distributed models alike): under CPU bf16
autocast attention runs in fp32, linears in bf16."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import REPO, TINY_IMG_SIZE, child_env

from networks.vit import VisionTransformer
from utils.data.synthetic import generate

# bf16 keeps 8 significant bits (relative rounding error up to 2^-9 ~ 0.2%); the tiny ViT's
# bf16 output is ~0.4% (relative L2) away from fp32, as is the cpu_short model's. 2% leaves
# room for other seeds and shapes while still catching a precision bug.
BF16_REL_TOL = 2e-2


@pytest.mark.e2e
def test_bench_step_smoke(tmp_path: Path) -> None:
    generate(tmp_path, img_size=TINY_IMG_SIZE, samples_per_year=24, train_years=1,
             valid_years=1, test_years=1)
    cmd = [sys.executable, "-m", "bench.bench_step", "--config", "tiny", "--iters", "3",
           "--repeats", "2", "--ceiling_size", "1024"]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env({"DATA_DIR": str(tmp_path)}),
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "no data at" not in out, "DATA_DIR was not used"
    assert "framework overhead (c)/(b)" in proc.stdout, out[-4000:]
    assert "model FLOP/s (c):" in proc.stdout and "of the fp32 ceiling" in proc.stdout
    assert "(a) matmul ceiling" in proc.stdout


def tiny_vit() -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(img_size=TINY_IMG_SIZE, patch_size=4, in_chans=20, out_chans=20,
                             embed_dim=32, depth=2, num_heads=4)


def record_dtypes(model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Dtypes seen by SDPA (its q, k, v) and produced by every nn.Linear."""
    seen: dict[str, list] = {"sdpa": [], "linear": []}
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen["sdpa"].append((q.dtype, k.dtype, v.dtype))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, inp, out: seen["linear"].append(out.dtype))
    return seen


def test_cpu_bf16_policy_attention_fp32_linears_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_vit()
    x = torch.randn(2, 20, *TINY_IMG_SIZE)
    with torch.no_grad():
        ref = model(x)
    seen = record_dtypes(model, monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert len(seen["sdpa"]) == 2  # depth 2
    assert all(d == (torch.float32,) * 3 for d in seen["sdpa"]), seen["sdpa"]
    assert seen["linear"] and all(d == torch.bfloat16 for d in seen["linear"]), seen["linear"]
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < BF16_REL_TOL, f"bf16 output is {rel:.3%} from fp32 (limit {BF16_REL_TOL:.0%})"
    out.float().square().mean().backward()  # the fp32 island is differentiable
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.parameters())


def test_fp32_unchanged_without_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_vit()
    seen = record_dtypes(model, monkeypatch)
    model(torch.randn(1, 20, *TINY_IMG_SIZE))
    assert all(d == (torch.float32,) * 3 for d in seen["sdpa"])
    assert all(d == torch.float32 for d in seen["linear"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_keeps_reduced_precision_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_vit().cuda()
    seen = record_dtypes(model, monkeypatch)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(torch.randn(1, 20, *TINY_IMG_SIZE, device="cuda"))
    assert all(d == (torch.bfloat16,) * 3 for d in seen["sdpa"]), seen["sdpa"]
