"""The benchmark's yardsticks (bench/ceilings.py, bench/floor.py, bench/time_split.py,
bench/budget.py): the shape-true ceiling records exactly the GEMMs and attention calls of a
training step, the elementwise floor counts each gap between them as one fused pass, the
matmul ceiling sizes itself to the machine, the time split adds up (and names the causes of
the elementwise time), and the budget alarm interrupts. No timing assertions."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import TINY_IMG_SIZE
from torch.profiler import record_function

from bench.budget import Budget, OverBudget
from bench.ceilings import MatmulCeiling, Ref, ShapeTrueCeiling, precision_label
from bench.floor import ElementwiseFloor, MachineRates
from bench.time_split import (
    CATEGORIES,
    CAUSES,
    LOADER_RANGE,
    LOSS_RANGE,
    category,
    cause,
    profile_split,
)
from networks.loss import l2_loss
from networks.vit import VisionTransformer

CPU = torch.device("cpu")
B, C, P, D, DEPTH, HEADS = 2, 20, 4, 32, 2, 4


def tiny_vit() -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(img_size=TINY_IMG_SIZE, patch_size=P, in_chans=C, out_chans=C,
                             embed_dim=D, depth=DEPTH, num_heads=HEADS)


def record(model: VisionTransformer, dtype: torch.dtype | None) -> ShapeTrueCeiling:
    x, y = torch.randn(B, C, *TINY_IMG_SIZE), torch.randn(B, C, *TINY_IMG_SIZE)

    def forward_backward() -> None:
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = l2_loss(model(x), y)
        loss.backward()

    return ShapeTrueCeiling.record(forward_backward, CPU).prepare()


def test_every_linear_gives_three_gemms_and_the_patch_embedding_two():
    ceiling = record(tiny_vit(), None)
    N = (TINY_IMG_SIZE[0] // P) * (TINY_IMG_SIZE[1] // P)
    linears = [(D, 3 * D), (D, D), (D, 4 * D), (4 * D, D)] * DEPTH + [(D, C * P * P)]
    assert ceiling.counts() == {"gemm": 3 * len(linears) + 2, "attention": 2 * DEPTH, "fft": 0}
    # forward, input gradient and weight gradient of each Linear: 3 x 2 M K N; the patch
    # embedding has no input gradient (the input needs none): 2 x 2 M K N.
    expected = 3 * sum(2 * B * N * k * n for k, n in linears) + 2 * (2 * B * N * C * P * P * D)
    assert ceiling.gemm_gflop * 1e9 == pytest.approx(expected)


def test_bf16_autocast_records_bf16_gemms_and_the_math_path_attention_as_gemms():
    """CPU bf16 policy for short sequences (networks.kernels.attention): attention is two
    bf16 matmuls forward and four backward per block, no SDPA kernel."""
    ceiling = record(tiny_vit(), torch.bfloat16)
    linears = 4 * DEPTH + 1
    assert ceiling.counts() == {"gemm": 3 * linears + 2 + 6 * DEPTH, "attention": 0, "fft": 0}
    gemm_dtypes = {s.dtype for c in ceiling.calls if c.kind == "gemm" for s in c.args
                   if hasattr(s, "dtype")}
    # the patch embedding's two included: a bf16 GEMM on CPU (networks.kernels.patch_conv)
    assert gemm_dtypes == {torch.bfloat16}


def test_attention_backward_replays_on_its_forwards_tensors():
    ceiling = record(tiny_vit(), None)
    backward = [c for c in ceiling.calls if c.kind == "attention" and "backward" in str(c.op)]
    assert len(backward) == DEPTH
    for call in backward:
        refs = [a for a in call.args if isinstance(a, Ref)]
        # q, k, v (inputs of the forward), its output and log-sum-exp
        assert sorted((r.output, r.index) for r in refs) == [
            (False, 0), (False, 1), (False, 2), (True, 0), (True, 1)]
    assert ceiling.seconds(tries=1) > 0
    split = ceiling.split(tries=1)
    assert set(split) == {"gemm", "attention", "fft"}
    assert split["gemm"] > 0 and split["attention"] > 0


def test_the_matmul_ceiling_shrinks_or_skips_a_precision_too_slow_for_its_budget():
    sized = MatmulCeiling(CPU, [torch.float32], n=512, max_call_s=60.0)
    assert sized.sizes == {torch.float32: 512} and sized.gflops(torch.float32) > 0
    skipped = MatmulCeiling(CPU, [torch.float32, torch.bfloat16], n=2048, max_call_s=1e-9)
    assert skipped.sizes == {} and set(skipped.skipped) == {torch.float32, torch.bfloat16}
    assert skipped.gflops(torch.bfloat16) is None
    # the label names bf16 as emulated on a CPU without native bf16 (AVX2): either way skipped
    assert f"{precision_label(torch.bfloat16, CPU)} skipped" in skipped.describe()


@pytest.mark.parametrize("name, ancestors, expected", [
    ("aten::addmm", (), "GEMM"), ("aten::mm", ("autograd::engine",), "GEMM"),
    ("aten::mkldnn_convolution", (), "GEMM"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", (), "attention"),
    ("aten::native_layer_norm", (), "elementwise+norm"), ("aten::gelu", (), "elementwise+norm"),
    ("aten::_fused_adam_", ("Optimizer.step#Adam.step",), "optimizer"),
    ("aten::copy_", (LOADER_RANGE,), "loader"), ("aten::_fft_r2c", (), "FFT"),
    ("AddmmBackward0", (), "Python+framework"), ("bench: full step", (), "Python+framework"),
])
def test_profiler_events_fall_into_one_category_each(name, ancestors, expected):
    assert category(name, (*ancestors, name)) == expected


@pytest.mark.parametrize("name, ancestors, expected", [
    ("aten::copy_", ("aten::to", "aten::_to_copy"), "casts"),
    ("aten::copy_", ("ToCopyBackward0",), "casts"),
    ("aten::copy_", ("aten::reshape", "aten::clone"), "layout reorders"),
    ("aten::native_layer_norm_backward", (), "norms"),
    ("aten::gelu_backward", (), "activations"),
    ("aten::_softmax", (), "softmax"),
    ("graph_0_cpp_fused__softmax_clone_transpose_unbind_view_3", (), "softmax"),
    ("graph_0_cpp_fused__to_copy_add_native_layer_norm_backward_view_5", (), "norms"),
    ("graph_0_cpp_fused_mul_stack_transpose_view_8", (), "layout reorders"),
    ("graph_0_cpp_fused__to_copy_sum_view_2", (), "adds, muls, sums"),
    ("cpp_fused__to_copy_0", (), "casts"),
    ("aten::fill_", (), "copies"),
])
def test_elementwise_time_falls_into_one_cause_each(name, ancestors, expected):
    assert cause(name, (*ancestors, name)) == expected
    assert cause(name, (*ancestors, name), in_loss=True) == "loss"


def test_the_time_split_of_a_real_step_adds_up_and_finds_the_loss():
    model = tiny_vit()
    optimizer = torch.optim.Adam(model.parameters())
    batch = torch.randn(B, C, *TINY_IMG_SIZE)

    def step() -> None:
        with record_function(LOADER_RANGE):
            inp = batch.clone()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(inp)
        with record_function(LOSS_RANGE):
            loss = l2_loss(out, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    split = profile_split(step, steps=2)
    assert tuple(split.shares) == CATEGORIES and tuple(split.causes) == CAUSES
    assert sum(split.shares.values()) == pytest.approx(1.0)
    for key in ("GEMM", "optimizer", "loader", "elementwise+norm"):
        assert split.shares[key] > 0, key
    assert sum(split.causes.values()) == pytest.approx(split.seconds["elementwise+norm"])
    assert sum(split.ops.values()) == pytest.approx(split.seconds["elementwise+norm"])
    for kind in ("loss", "casts", "norms", "activations", "softmax"):
        assert split.causes[kind] > 0, kind
    assert split.cast_calls > 0  # autocast's casts, eager


def test_the_floor_counts_one_pass_per_gap_between_gemms():
    """x -> mm -> gelu -> * 2 -> mm: the gap between the two GEMMs reads the first GEMM's
    output once and writes what the second reads once (the intermediate of the two
    elementwise ops costs nothing), with one erf per element."""
    a, w = torch.randn(64, 32), torch.randn(32, 48)

    def forward() -> None:
        h = torch.nn.functional.gelu(a @ w) * 2
        h @ w.t()

    floor = ElementwiseFloor.record(forward, params=0)
    assert len(floor.passes) == 1
    gap = floor.passes[0]
    assert (gap.read, gap.written, gap.transcendentals) == (64 * 48 * 4, 64 * 48 * 4, 64 * 48)
    floor.rates = MachineRates(bandwidth=1e9, transcendental=1e9, size_mb=1)
    assert floor.seconds() == pytest.approx(2 * 64 * 48 * 4 / 1e9)


def test_the_floor_of_a_vit_step_has_fewer_bytes_per_pass_in_bf16():
    model = tiny_vit()
    x, y = torch.randn(B, C, *TINY_IMG_SIZE), torch.randn(B, C, *TINY_IMG_SIZE)
    floors = {}
    for dtype in (None, torch.bfloat16):
        def fwd_bwd(dtype: torch.dtype | None = dtype) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
                out = model(x)
            l2_loss(out, y).backward()

        floors[dtype] = ElementwiseFloor.record(fwd_bwd, params=1)
        assert floors[dtype].passes and all(g.nbytes > 0 for g in floors[dtype].passes)
    # fp32: softmax is inside the flash kernel (the ceiling's); bf16 attends with matmuls,
    # so its softmax and GELU are elementwise passes with transcendentals
    t = {d: sum(g.transcendentals for g in f.passes) for d, f in floors.items()}
    assert t[torch.bfloat16] > t[None] > 0


def test_the_budget_alarm_interrupts_a_long_set_up():
    budget = Budget(10.0)
    with pytest.raises(OverBudget):
        with budget.alarm(0.2):
            time.sleep(5)
    with budget.alarm(5.0):  # a body that ends in time is not interrupted
        time.sleep(0.01)
    with pytest.raises(OverBudget):
        with budget.alarm(0.0):
            pass


def test_a_shape_true_ceiling_too_slow_to_replay_is_skipped(tiny_params, tmp_path, capsys):
    """An emulated precision (bf16 on an AVX2-only CPU: 0.9 GFLOP/s) would spend minutes
    replaying one step's GEMMs; its probe rate, injected here, predicts that, and the
    ceiling is skipped instead of eating the budget."""
    from bench.bench_step import limits_of
    from bench.step_runner import StepRunner
    from distributed.launch_env import resolve_launch_env
    from distributed.layout import Layout

    cfg = tiny_params.replace(expdir=str(tmp_path), amp_mode="bf16")
    runner = StepRunner("tiny bf16", cfg, Layout.of_groups(cfg, resolve_launch_env(), CPU))
    mm = MatmulCeiling(CPU, [torch.bfloat16], n=256)
    ceilings, floors = limits_of([runner], mm, Budget(60.0))
    assert set(ceilings) == set(floors) == {"tiny bf16"}
    mm.probe[torch.bfloat16] = 1e-6  # GFLOP/s: the replay would take hours
    ceilings, floors = limits_of([runner], mm, Budget(60.0))
    assert ceilings == {} and set(floors) == {"tiny bf16"}  # the floor replays nothing
    assert "'tiny bf16': shape-true ceiling skipped" in capsys.readouterr().err
    runner.close()
