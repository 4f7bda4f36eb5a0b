"""CPU bf16: train.py and train_mp.py (tp 2, cp 2) compute alike, because the serial and the
distributed attention share one precision policy (networks.kernels.attention decides in which
precision attention runs on CPU under autocast).

Two proofs:
  - in process: DistributedAttention under CPU bf16 autocast hands SDPA q, k, v of the same
    dtypes as the serial Attention does, and gives its output (same weights) to bf16 rounding;
  - end to end: 16 bf16 steps of the tiny config log the same losses with train.py and with
    train_mp.py --tp 2 / --cp 2. Tolerance: 1e-4 relative. Measured differences are ~3e-6
    (the last printed digit): the layouts change only where sums happen, each bf16 product
    is the same. A different precision path in one layout would show as a persistent offset.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import run_distributed, run_script
from sharded import load_serial_state_dict

from distributed import comm
from distributed.helpers import compute_split_shapes
from distributed.layers import DistributedAttention, TokenSplit
from networks import kernels as precision
from networks.vit import Attention

LOSS_RTOL = 1e-4
DIM, HEADS, TOKENS = 32, 4, 10


def _attention_dtypes_and_output(tp: int, cp: int) -> None:
    comm.init(tp=tp, cp=cp)
    torch.manual_seed(0)
    serial = Attention(DIM, HEADS)
    tokens = TokenSplit()
    layer = DistributedAttention(DIM, HEADS, tokens=tokens)
    load_serial_state_dict(layer, serial.state_dict())
    x = torch.randn(2, TOKENS, DIM)
    tokens.sizes = compute_split_shapes(TOKENS, cp)
    mine = x.split(tokens.sizes, dim=1)[comm.get_rank("cp")]
    seen = []  # which kernel each attention call ran, and in which dtypes
    sdpa, math = F.scaled_dot_product_attention, precision.math_attention

    def spy_sdpa(q, k, v, *args, **kwargs):
        seen.append(("sdpa", q.dtype, k.dtype, v.dtype))
        return sdpa(q, k, v, *args, **kwargs)

    def spy_math(q, k, v, dropout_p, dtype):
        seen.append(("math", dtype))
        return math(q, k, v, dropout_p, dtype)

    F.scaled_dot_product_attention, precision.math_attention = spy_sdpa, spy_math
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = serial(x).split(tokens.sizes, dim=1)[comm.get_rank("cp")]
            out = layer(mine)
    finally:
        F.scaled_dot_product_attention, precision.math_attention = sdpa, math
    assert len(seen) == 2 and seen[0] == seen[1], seen  # serial, then distributed: one policy
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 1e-2, f"distributed attention is {rel:.2%} from the serial one under bf16"


@pytest.mark.distributed
@pytest.mark.parametrize("tp,cp", [(2, 1), (1, 2)])
def test_distributed_attention_follows_the_serial_precision_policy(tp: int, cp: int) -> None:
    run_distributed(_attention_dtypes_and_output, tp * cp, tp, cp)


def _losses(run) -> list[float]:
    assert run.returncode == 0, run.output[-3000:]
    return [float(v) for v in re.findall(r"Avg (?:train|val) loss=([0-9.]+)", run.stdout)]


@pytest.mark.e2e
def test_bf16_losses_of_train_and_train_mp_agree(tiny_data, tmp_path) -> None:
    flags = ["--config=tiny", "--num_iters=16", "--amp_mode=bf16"]
    runs = {name: run_script(script, flags + extra, data_dir=tiny_data, log_dir=tmp_path / name,
                             nproc=nproc, timeout=240)
            for name, script, extra, nproc in (("serial", "train.py", [], None),
                                               ("tp2", "train_mp.py", ["--tp=2"], 2),
                                               ("cp2", "train_mp.py", ["--cp=2"], 2))}
    serial = _losses(runs["serial"])
    assert len(serial) == 4  # two epochs: train and val each
    for name in ("tp2", "cp2"):
        other = _losses(runs[name])
        assert other == pytest.approx(serial, rel=LOSS_RTOL), (name, other, serial)


def test_the_cpu_attention_path_depends_on_the_sequence_not_on_the_local_queries() -> None:
    """A context-parallel rank holds a slice of the queries and all the keys: it must take
    the kernel the serial model takes for the whole sequence."""
    n = math.isqrt(precision.MATH_PATH_MAX_SCORES) + 1  # just past the math-path limit
    seen = []
    sdpa, math_path = F.scaled_dot_product_attention, precision.math_attention
    F.scaled_dot_product_attention = lambda *a, **kw: seen.append("sdpa") or sdpa(*a, **kw)
    precision.math_attention = lambda *a, **kw: seen.append("math") or math_path(*a, **kw)
    try:
        k = torch.randn(1, 1, n, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for queries in (n, n // 2):  # serial, and a cp = 2 rank
                precision.attention(torch.randn(1, 1, queries, 8), k, k)
    finally:
        F.scaled_dot_product_attention, precision.math_attention = sdpa, math_path
    assert seen == ["sdpa", "sdpa"], seen
