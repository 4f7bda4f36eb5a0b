"""The time model's operator rates (planning/rates.py) and the machine file `make gpu-check`
writes (tools/gpu_check/rates.py):

  - the published defaults grow with an operator's size and stay below the data-sheet peak,
    for every GPU the model knows; a curve is linear in log(size) between its points and
    flat beyond them; attention runs at the kernel's head dim (a multiple of 32);
  - a machine file round-trips (write, read: the same rates), and a bad one is refused in
    one line naming the file and the entry;
  - the gpu-check's sweep runs on a CPU (small shapes), writes a machine file, and the dry
    run reads it in place of the defaults (where this PyTorch runs the dry run).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench import dry_run
from planning.fake_world import runs_collectives_on_fake_tensors
from planning.machines import GPUS
from planning.rates import (
    Curve,
    MachineRates,
    default_rates,
    read_machine_file,
    write_machine_file,
)
from tools.gpu_check import rates as sweep
from utils.errors import UserError

SIZES = [10.0**e for e in range(3, 14)]
# The dry run steps on fake tensors through the collectives: an older PyTorch cannot.
FAKE_STEPS = pytest.mark.skipif(not runs_collectives_on_fake_tensors(),
                                reason=f"PyTorch {torch.__version__} has no fake kernels for "
                                "the c10d collectives")


def _rising(curve: Curve) -> bool:
    values = [curve(s) for s in SIZES]
    return all(b >= a for a, b in zip(values, values[1:], strict=False))


@pytest.mark.parametrize("name", sorted(GPUS))
def test_default_rates_grow_with_size_and_stay_below_the_peaks(name: str) -> None:
    gpu, rates = GPUS[name], default_rates(GPUS[name])
    for dtype, curve in rates.gemm_curves.items():
        peak = gpu.peak({"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype,
                                                                          torch.float32))
        assert _rising(curve), dtype
        assert 0 < curve(SIZES[0]) < curve(SIZES[-1]) < peak
    for dtype, by_dim in rates.attention_curves.items():
        for head_dim, curve in by_dim.items():
            assert _rising(curve), (dtype, head_dim)
            assert curve(1e9) < gpu.peak(torch.bfloat16)
    assert _rising(rates.memory_curve) and rates.memory(1e12) < gpu.hbm
    # a wider head reaches more of the peak (FlashAttention-2 at 128 against 64)
    assert rates.attention("bf16", 128, 4096) > rates.attention("bf16", 64, 4096)


def test_a_curve_is_linear_in_log_size_between_its_points_and_flat_beyond() -> None:
    curve = Curve(((1e6, 10.0), (1e8, 30.0), (1e9, 40.0)))
    assert curve(1e6) == 10.0 and curve(1e8) == 30.0 and curve(1e9) == 40.0
    assert curve(1e7) == pytest.approx(20.0)  # the log-midpoint: the mean
    assert curve(1e3) == 10.0 and curve(1e15) == 40.0
    assert Curve(((2.0, 1.0), (1.0, 2.0))).problems("x") == ["x: sizes must increase"]


def test_attention_runs_at_the_kernels_head_dim() -> None:
    rates = default_rates(GPUS["a100-40gb"])
    kernel64 = rates.attention_curves["bf16"][64](4050)
    assert rates.attention("bf16", 48, 4050) == pytest.approx(kernel64 * 48 / 64)
    assert rates.attention("bf16", 64, 4050) == pytest.approx(kernel64)
    # beyond the widest kernel measured: the widest's rate
    assert rates.attention("bf16", 256, 4050) == pytest.approx(
        rates.attention_curves["bf16"][128](4050))


def test_a_machine_file_round_trips(tmp_path) -> None:
    path = tmp_path / "machine.json"
    rates = default_rates(GPUS["h100"])
    write_machine_file(path, rates)
    back = read_machine_file(path)
    assert back.gemm_curves == rates.gemm_curves
    assert back.attention_curves == rates.attention_curves
    assert back.memory_curve == rates.memory_curve
    assert (back.launch_s, back.h2d_bytes_per_s, back.host_bytes_per_s) == \
        (rates.launch_s, rates.h2d_bytes_per_s, rates.host_bytes_per_s)


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.pop("memory"), "missing entry 'memory'"),
    (lambda d: d.update(format="other"), "not a machine file"),
    (lambda d: d["gemm"].update(bf16=[[2e9, 1e12], [1e9, 2e12]]), "gemm bf16: sizes must"),
    (lambda d: d["gemm"].update(bf16="fast"), "gemm bf16: expected a list of [size, rate]"),
    (lambda d: d["gemm"].pop("fp32"), "no gemm or attention rates for fp32"),
])
def test_a_bad_machine_file_is_refused_in_one_line(tmp_path, edit, words) -> None:
    path = tmp_path / "machine.json"
    data = default_rates(GPUS["a100-40gb"]).to_json()
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=str(path)) as e:
        read_machine_file(path)
    assert words in str(e.value) and "\n" not in str(e.value)
    path.write_text("{not json")
    with pytest.raises(UserError, match="not JSON"):
        read_machine_file(path)
    with pytest.raises(UserError, match="cannot read it"):
        read_machine_file(tmp_path / "missing.json")


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple:
    """The gpu-check's sweep on this CPU (small shapes): its line and machine file."""
    out = tmp_path_factory.mktemp("rates")
    outcome = sweep.measure_and_write(torch.device("cpu"), out, out, small=True)
    return outcome, out / sweep.MACHINE_FILE


def test_the_gpu_checks_sweep_writes_a_machine_file(swept) -> None:
    outcome, path = swept
    assert outcome.ok and outcome.data["machine_file"] == str(path)
    rates = read_machine_file(path)
    assert isinstance(rates, MachineRates) and rates.name == "cpu"
    for curve in [*rates.gemm_curves.values(), rates.memory_curve,
                  *(c for by in rates.attention_curves.values() for c in by.values())]:
        assert not curve.problems("measured") and len(curve.points) >= 2
    assert all(math.isfinite(v) and v > 0 for v in
               (rates.launch_s, rates.h2d_bytes_per_s, rates.host_bytes_per_s))


@FAKE_STEPS
def test_the_dry_run_reads_the_sweeps_machine_file(swept, capsys) -> None:
    _, path = swept
    assert dry_run.main(["--config", "tiny", "--gpus", "1", "--machine_file", str(path),
                         "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["rates"] == "cpu" and row["compute_factor"] == 1.0 and row["step_s"] > 0
    # a CPU's rates are slower than an A100's defaults: the same step takes longer
    assert dry_run.main(["--config", "tiny", "--gpus", "1", "--json"]) == 0
    [default] = json.loads(capsys.readouterr().out)
    assert default["rates"] == "a100-40gb" and row["step_s"] > default["step_s"]
