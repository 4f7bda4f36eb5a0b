"""Precision chosen by the hardware: which reduced precisions a CPU runs natively (from
PyTorch's CPU feature flags and the ISA caps of the environment, Arm's bf16 feature, or
injected with CPU_NATIVE_PRECISION), the CPU class a run reports, what `amp_mode: auto`
resolves to, and the one-line warning when an explicit bf16 is only emulated.

Other CPU classes run here two ways: their feature flags injected (AVX2-only, AVX-512
without bf16, Sapphire Rapids, Arm), or, for real, under the caps that make this CPU compute
in that class's instruction set (`utils.hardware.CLASS_CAPS`)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import CONFIG_FILE, REPO

from utils.config import load_yaml, read_config
from utils.errors import ConfigError
from utils.hardware import (
    CLASS_CAPS,
    ENV_OVERRIDE,
    CpuClass,
    CpuPrecision,
    cpu_features,
    cpu_precision,
    detect_native,
    measure_slowdown,
    onednn_cap,
    parse_override,
)
from utils.precision import auto_amp_mode, choose_precision, warn_once

CPU = torch.device("cpu")
FLAGS = ("avx2", "avx512_f", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")
AVX2_ONLY = dict.fromkeys(FLAGS, False) | {"avx2": True}
AVX512_NO_BF16 = AVX2_ONLY | {"avx512_f": True}          # e.g. Skylake-SP: bf16 emulated
AVX512_BF16 = AVX512_NO_BF16 | {"avx512_bf16": True}      # e.g. Zen 4
SAPPHIRE_RAPIDS = AVX512_BF16 | {"amx_bf16": True, "avx512_fp16": True}
GRANITE_RAPIDS = SAPPHIRE_RAPIDS | {"amx_fp16": True}


@pytest.mark.parametrize("features, native", [
    (AVX2_ONLY, set()), (AVX512_NO_BF16, set()), (AVX512_BF16, {"bf16"}),
    (AVX2_ONLY | {"amx_bf16": True}, {"bf16"}), (SAPPHIRE_RAPIDS, {"bf16", "fp16"}),
    (GRANITE_RAPIDS, {"bf16", "fp16"}), (AVX2_ONLY | {"amx_fp16": True}, {"fp16"}),
])
def test_native_precisions_follow_the_x86_feature_flags(features, native):
    found = detect_native(features, "x86_64")
    assert found.native == native
    decisive = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")
    assert found.evidence == (", ".join(f for f in decisive if features[f])
                              or f"none of {', '.join(decisive)}")


def test_this_machine_is_detected_from_torchs_own_flags():
    features = cpu_features()
    if not features:
        pytest.skip("this PyTorch does not expose CPU feature flags")
    native = cpu_precision(environ={}).native
    assert ("bf16" in native) == (features.get("avx512_bf16") or features.get("amx_bf16"))


@pytest.mark.parametrize("value, native", [
    ("none", set()), ("bf16", {"bf16"}), ("bf16,fp16", {"bf16", "fp16"}), (" FP16 ", {"fp16"}),
])
def test_the_environment_variable_replaces_detection(value, native):
    got = cpu_precision(environ={ENV_OVERRIDE: value})
    assert got.native == native and ENV_OVERRIDE in got.evidence


@pytest.mark.parametrize("value", ["fp8", "bf16,int8", ","])
def test_a_bad_environment_value_is_a_one_line_config_error(value):
    with pytest.raises(ConfigError, match=f"{ENV_OVERRIDE}=.*expected 'none' or"):
        parse_override(value)


@pytest.mark.parametrize("environ, level", [
    ({}, None), ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, "AVX2"),
    ({"ONEDNN_MAX_CPU_ISA": "avx512_core_amx"}, "AVX10_1_512_AMX"),  # an alias, any case
    ({"DNNL_MAX_CPU_ISA": "AVX512_CORE"}, "AVX512_CORE"),  # oneDNN's older name
    ({"ONEDNN_MAX_CPU_ISA": "ALL"}, None), ({"ONEDNN_MAX_CPU_ISA": "AVX9000"}, None),
])
def test_the_onednn_isa_cap_is_read_as_onednn_reads_it(environ, level):
    assert onednn_cap(environ)[0] == level


@pytest.mark.parametrize("features, cap, native, evidence", [
    (AVX512_BF16, "AVX2", set(), "avx512_bf16 above ONEDNN_MAX_CPU_ISA=AVX2"),
    (AVX512_BF16, "AVX512_CORE", set(), "avx512_bf16 above ONEDNN_MAX_CPU_ISA=AVX512_CORE"),
    (AVX512_BF16, "AVX512_CORE_BF16", {"bf16"}, "avx512_bf16"),
    (SAPPHIRE_RAPIDS, "AVX512_CORE_BF16", {"bf16"},
     "avx512_bf16; amx_bf16, avx512_fp16 above ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"),
    (SAPPHIRE_RAPIDS, "AVX10_1_512_AMX", {"bf16", "fp16"}, "avx512_bf16, amx_bf16, avx512_fp16"),
])
def test_an_isa_cap_below_an_instruction_makes_its_precision_emulated(features, cap, native,
                                                                      evidence):
    """Native only if the hardware has it AND the cap lets oneDNN use it."""
    found = detect_native(features, "x86_64", cap, f"ONEDNN_MAX_CPU_ISA={cap}")
    assert (found.native, found.evidence) == (native, evidence)


@pytest.mark.parametrize("arm, onednn, native, evidence", [
    (frozenset({"fp", "asimd", "bf16", "i8mm"}), frozenset({"bf16"}), {"bf16"},
     "bf16 in the aarch64 CPU's features"),
    (frozenset({"fp", "asimd"}), frozenset({"bf16"}), set(), "no bf16 among"),
    (frozenset({"bf16"}), frozenset(), set(), "but this PyTorch's oneDNN does not run it"),
    (None, frozenset({"bf16"}), {"bf16"}, "oneDNN on aarch64"),  # features not readable
])
def test_arm_bf16_is_native_where_the_core_has_it_and_onednn_runs_it(arm, onednn, native,
                                                                     evidence):
    found = detect_native({}, "aarch64", arm_features=arm, onednn=onednn)
    assert found.native == native and evidence in found.evidence, found


@pytest.mark.parametrize("machine, isa, native, amx, name, summary", [
    ("x86_64", "AVX2", set(), False, "avx2", "AVX2, bf16 emulated"),
    ("x86_64", "AVX512", set(), False, "avx512", "AVX512, bf16 emulated"),
    ("x86_64", "AVX512", {"bf16"}, False, "avx512_bf16", "AVX512, native bf16"),
    ("x86_64", "AVX512", {"bf16", "fp16"}, True, "amx", "AVX512 + AMX, native bf16"),
    ("aarch64", "DEFAULT", set(), False, "arm", "aarch64 DEFAULT, bf16 emulated"),
    ("aarch64", "SVE256", {"bf16"}, False, "arm_sve256_bf16", "aarch64 SVE256, native bf16"),
])
def test_the_class_names_the_isa_and_whether_bf16_is_native(machine, isa, native, amx, name,
                                                            summary):
    cls = CpuClass(machine, isa, CpuPrecision(frozenset(native), "flags"), amx)
    assert (cls.name, cls.summary()) == (name, summary)
    assert cls.describe() == f"CPU class {name}: {summary} (flags)"
    capped = CpuClass(machine, isa, CpuPrecision(frozenset(native), "flags"), amx, "X=1")
    assert capped.describe().endswith("; caps X=1: that class's instruction set, not its "
                                      "clock or cores")


def test_the_caps_of_the_avx2_class_make_torch_compute_as_an_avx2_cpu():
    """For real, in a new process (the caps act when torch loads): ISA, class and the
    auto choice all follow the cap; this CPU's own flags still show AVX-512 if it has it."""
    if not cpu_features().get("avx2"):
        pytest.skip("this CPU has no AVX2")
    code = ("import torch; from utils.hardware import cpu_class; "
            "from utils.precision import auto_amp_mode; c = cpu_class(); "
            "print(torch.backends.cpu.get_cpu_capability(), c.name, "
            "auto_amp_mode(torch.device('cpu')), torch.ops.mkldnn._is_mkldnn_bf16_supported())")
    env = {k: v for k, v in os.environ.items() if k != ENV_OVERRIDE} | CLASS_CAPS["avx2"]
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    assert out == ["AVX2", "avx2", "none", "False"], out


@pytest.mark.parametrize("native, expected", [
    (set(), "none"), ({"fp16"}, "none"), ({"bf16"}, "bf16"), ({"bf16", "fp16"}, "bf16")])
def test_auto_on_a_cpu_is_bf16_only_where_bf16_is_native(native, expected):
    assert auto_amp_mode(CPU, CpuPrecision(frozenset(native), "injected")) == expected


def test_no_cpu_opt_config_computes_in_a_precision_an_avx2_cpu_emulates():
    """`_opt` never slower than the baseline on an AVX2-only CPU: every CPU `_opt` config
    asks for `auto` (fp32 there) or fp32, never for a bf16 that CPU would emulate."""
    avx2 = detect_native(AVX2_ONLY, "x86_64")
    names = [n for n in load_yaml(CONFIG_FILE) if n.startswith("cpu_") and "opt" in n]
    assert "cpu_short_opt" in names and "cpu_afno_short_opt" in names
    for name in names:
        mode = read_config(CONFIG_FILE, name, environ={}).amp_mode
        assert mode in ("auto", "none") and (mode == "none" or
                                             auto_amp_mode(CPU, avx2) == "none"), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_a_gpu_is_bf16_where_supported_else_fp16():
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    assert auto_amp_mode(torch.device("cuda")) == expected


@pytest.mark.parametrize("native", [set(), {"bf16"}])
def test_auto_resolves_in_autocast_and_the_scaler(monkeypatch, native):
    monkeypatch.setenv(ENV_OVERRIDE, ",".join(native) or "none")
    precision = choose_precision("auto", CPU)
    with precision.autocast():
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    assert dtype == (torch.bfloat16 if native else None) == precision.dtype
    assert not precision.grad_scaler().is_enabled()


def test_choosing_auto_gives_the_hardwares_choice_and_logs_why(caplog):
    with caplog.at_level(logging.INFO, logger="train"):
        none = CpuPrecision(frozenset(), "no avx512_bf16")
        assert choose_precision("auto", CPU, none).mode == "none"
        bf16 = CpuPrecision(frozenset({"bf16"}), "avx512_bf16, amx_bf16")
        assert choose_precision("auto", CPU, bf16).mode == "bf16"
    assert "amp_mode auto -> none: no native bf16 on this CPU (no avx512_bf16)" in caplog.text
    assert "amp_mode auto -> bf16: native on this CPU (avx512_bf16, amx_bf16)" in caplog.text


def test_explicit_bf16_on_a_cpu_that_emulates_it_warns_once_with_the_slowdown(caplog):
    warn_once.cache_clear()
    cpu = CpuPrecision(frozenset(), f"{ENV_OVERRIDE}=none")
    with caplog.at_level(logging.INFO, logger="train"):
        for _ in range(2):  # a second choice (e.g. a second build) does not repeat it
            assert choose_precision("bf16", CPU, cpu).mode == "bf16"  # still trains in bf16
    lines = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert re.search(r"amp_mode bf16 is emulated on this CPU \(.*CPU_NATIVE_PRECISION=none\): "
                     r"a 256\^3 matmul measured [\d.]+x the time of fp32 \([\d.]+ vs [\d.]+ "
                     r"GFLOP/s\)\. ", lines[0]), lines[0]
    # what to run instead: the side-by-side measurement, and the mode that trains at speed
    assert "python -m bench.bench_step --config <config> --amp_modes none bf16" in lines[0]
    assert lines[0].endswith("full speed here: --amp_mode auto (trains in fp32)"), lines[0]


def test_native_or_fp32_choices_do_not_warn(caplog):
    cpu = CpuPrecision(frozenset({"bf16"}), "avx512_bf16")
    with caplog.at_level(logging.INFO, logger="train"):
        for mode in ("bf16", "none"):
            choose_precision(mode, CPU, cpu)
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO]


@pytest.mark.parametrize("mode, native, line", [
    ("bf16", {"bf16"}, "Precision: bf16 autocast (amp_mode bf16: native on this CPU (flags))"),
    ("none", {"bf16"}, "Precision: fp32, no autocast (amp_mode none)"),
    ("auto", {"bf16"}, "Precision: bf16 autocast (amp_mode auto -> bf16: native on this CPU "
                       "(flags))"),
    ("auto", set(), "Precision: fp32, no autocast (amp_mode auto -> none: no native bf16 on "
                    "this CPU (flags))"),
    ("bf16", set(), "Precision: bf16 autocast, but amp_mode bf16 is emulated on this CPU"),
])
def test_every_choice_says_the_precision_in_one_line(caplog, mode, native, line):
    warn_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="train"):
        choose_precision(mode, CPU, CpuPrecision(frozenset(native), "flags"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(line), lines


def test_the_slowdown_probe_measures_both_precisions():
    rates = measure_slowdown("bf16", n=64, seconds=0.05)
    assert rates.n == 64 and rates.fp32 > 0 and rates.reduced > 0
    assert rates.slowdown == pytest.approx(rates.fp32 / rates.reduced)


# ----------------------------------------------------------------- train.py end to end

TINY = ["--config=tiny", "--num_iters=2"]


@pytest.mark.e2e
def test_explicit_bf16_without_native_bf16_trains_and_says_it_is_emulated(run_train):
    run = run_train("train.py", [*TINY, "--amp_mode=bf16"], env_extra={ENV_OVERRIDE: "none"})
    assert run.returncode == 0, run.output[-3000:]
    lines = [x for x in run.output.splitlines() if "is emulated on this CPU" in x]
    assert len(lines) == 1, run.output[-3000:]
    assert "WARNING" in lines[0] and "x the time of fp32" in lines[0]
    assert "Finished 2 iterations" in run.stdout


@pytest.mark.e2e
@pytest.mark.parametrize("native, mode", [("none", "none"), ("bf16", "bf16")])
def test_amp_mode_auto_follows_the_injected_cpu(run_train, native, mode):
    run = run_train("train.py", [*TINY, "--amp_mode=auto"], env_extra={ENV_OVERRIDE: native})
    assert run.returncode == 0, run.output[-3000:]
    assert f"amp_mode auto -> {mode}:" in run.stdout
    assert "is emulated on this CPU" not in run.output  # no warning: auto never emulates
    # the start-up line names the class the run computes in
    said = "native bf16" if native == "bf16" else "bf16 emulated"
    assert re.search(rf"training on CPU with \d+ threads; CPU class \w+: \w+, {said} "
                     rf"\({ENV_OVERRIDE}={native}\)", run.stdout), run.stdout[:3000]


@pytest.mark.e2e
def test_a_bad_capability_override_is_one_error_line(run_train):
    run = run_train("train.py", [*TINY, "--amp_mode=auto"], env_extra={ENV_OVERRIDE: "fp8"})
    assert run.returncode == 2, run.output[-3000:]
    assert "error: CPU_NATIVE_PRECISION='fp8': expected 'none' or" in run.output
    assert "Traceback" not in run.output
