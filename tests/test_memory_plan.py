"""The memory planner (bench/memory_plan.py, planning/memory.py) against real runs.

  - On 4 CPU ranks (gloo, torchrun), bench.bench_memory runs every layout the planner lists
    for a small ViT (dp, tp, cp and their products; DDP and FSDP; recompute or not) and a
    small AFNO (h x w meshes), two steps each, and measures rank 0's peak of allocated
    tensor bytes with the profiler's allocation events (not the resident set size; the
    least of three runs, bench/bench_memory.py says why): the planner's estimate of each,
    traced on fake tensors with the CPU's kernels, is within PEAK_RTOL of it.
  - The planner's command line: `--json` prints one object per layout with the keys the
    docs promise, every term beyond the tensors named, `fits` says whether the peak fits
    what CUDA reports of the GPU, one layout that fits is the fastest, `--layout` plans
    only the layouts it names, and a bad value is one `error:` line, exit 2.
  - The tutorial's published runs (`--published`): `mp` with tp 1 on 4 x 40 GB does not fit
    and tp 4 x dp 4 does, and every published figure (PyTorch's allocated bytes and the
    process's use at a failed request, NVML's used memory at step 2) is within 15 % of the
    planner's figure of the same quantity.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CONFIG_FILE, REPO, child_env

from planning.memory_terms import NAMES
from planning.published_memory import CALIBRATION, PUBLISHED, outside_allocator

pytestmark = pytest.mark.e2e

PEAK_RTOL = 0.15
PUBLISHED_RTOL = 0.15  # the aim: the tutorial's published figures within 15 %
RANKS = 4
# Small shapes, big enough that the activations, not the fixed few kilobytes, make the peak.
SECTIONS = {
    "vit": {"img_size": [32, 64], "embed_dim": 128},
    "afno": {"model": "afno", "img_size": [32, 64], "embed_dim": 128, "num_blocks": 4,
             "mlp_ratio": 4.0, "sparsity_threshold": 0.01, "hard_thresholding_fraction": 1.0,
             "parallel_order": "tp-cp-h-w-dp"},
}
WANT_LAYOUTS = {  # (tp, cp, h, w) of the splits each model must be measured in
    "vit": {(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (2, 2, 1, 1), (4, 1, 1, 1), (1, 4, 1, 1)},
    "afno": {(1, 1, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2), (1, 1, 2, 2), (1, 1, 4, 1),
             (1, 1, 1, 4)},
}
PLAN_KEYS = {"dp", "tp", "cp", "h", "w", "fsdp", "activation_checkpointing", "peak_gb",
             "after_forward_gb", "fits"}


def _yaml_with(tmp_path: Path, name: str, keys: dict) -> Path:
    """config/ViT.yaml with a section `name`: the tiny config with `keys`."""
    body = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in keys.items())
    path = tmp_path / "plan.yaml"
    path.write_text(CONFIG_FILE.read_text() + f"\n{name}:\n  <<: *tiny\n{body}")
    return path


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.distributed
@pytest.mark.parametrize("model", list(SECTIONS))
def test_the_planned_peak_is_within_15_percent_of_the_measured_one_in_every_layout(
        model: str, tmp_path: Path) -> None:
    yaml = _yaml_with(tmp_path, f"plan_{model}", SECTIONS[model])
    proc = _run(["bench.bench_memory", "--yaml_config", str(yaml), "--config",
                 f"plan_{model}", "--gpus", str(RANKS), "--iters", "0", "--json"], 600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = json.loads(proc.stdout)
    assert {(r["tp"], r["cp"], r["h"], r["w"]) for r in rows} == WANT_LAYOUTS[model]
    assert {(r["fsdp"], r["activation_checkpointing"]) for r in rows} == {
        (f, ac) for f in (False, True) for ac in ("none", "blocks")}
    wrong = [f"{r['dp']}x{r['tp']}x{r['cp']}x{r['h']}x{r['w']} fsdp={r['fsdp']} "
             f"{r['activation_checkpointing']}: planned {r['planned_mib']:.2f} MiB, measured "
             f"{r['measured_mib']:.2f} MiB" for r in rows if abs(r["error"]) > PEAK_RTOL]
    assert not wrong, "\n".join(wrong)
    for r in rows:  # the measurement itself: the step's tensors, more than the weights
        assert r["measured_mib"] > r["measured_after_forward_mib"] > 0, r


def test_the_planner_prints_one_json_object_per_layout_and_picks_one_that_fits() -> None:
    proc = _run(["bench.memory_plan", "--config", "tiny", "--gpus", "2", "--gpu_memory_gb",
                 "40", "--json"], 300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout)
    assert {(r["dp"], r["tp"], r["cp"], r["fsdp"], r["activation_checkpointing"])
            for r in rows} == {(dp, tp, cp, f, ac)
                               for dp, tp, cp in ((2, 1, 1), (1, 2, 1), (1, 1, 2))
                               for f in ((False, True) if dp > 1 else (False,))
                               for ac in ("none", "blocks")}
    for r in rows:
        assert PLAN_KEYS <= set(r), r
        assert r["usable_gb"] == pytest.approx(39.39)
        assert r["fits"] == (r["peak_gb"] <= 39.39) and 0 < r["after_forward_gb"] < r["peak_gb"]
        parts = sum(r[f"{p}_gb"] for p in ("parameters", "gradients", "optimizer",
                                           "activations", "communication"))
        assert tuple(r["terms_gb"]) == NAMES
        assert r["peak_gb"] == pytest.approx(parts + sum(r["terms_gb"].values()))
        assert r["communicators"] == 1  # two ranks: the world's communicator is every group
    fastest = [r for r in rows if r["fastest"]]
    # the rule: no model parallelism, no recompute, DDP before FSDP, when it fits
    assert [(r["dp"], r["fsdp"], r["activation_checkpointing"]) for r in fastest] == [
        (2, False, "none")]


def test_the_layout_option_plans_only_the_layouts_it_names() -> None:
    proc = _run(["bench.memory_plan", "--config", "tiny", "--gpus", "2", "--layout",
                 "dp=2,fsdp=yes,recompute=none", "--json"], 300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout)
    assert [(r["dp"], r["fsdp"], r["activation_checkpointing"]) for r in rows] == [
        (2, True, "none")]
    bad = _run(["bench.memory_plan", "--config", "tiny", "--gpus", "2", "--layout", "tp:2"], 120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --layout tp:2: 'tp:2' is not")
    assert bad.stderr.count("\n") == 1


def test_the_planner_reproduces_the_tutorials_published_memory_within_15_percent() -> None:
    proc = _run(["bench.memory_plan", "--published", "--json"], 600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    for row in report["rows"]:
        assert tuple(row["terms_gb"]) == NAMES and all(v >= 0 for v in row["terms_gb"].values())
    fits = {(f["edition"], f["tp"], f["gpu_memory_gb"]): f for f in report["fits"]}
    for (edition, tp, gb), f in fits.items():  # tp 1 fails on 40 GB only, as published
        expected = tp > 1 or gb > 40
        assert f["this_code_fits"] == f["tutorial_code_fits"] == expected, (edition, tp, gb)
    default = outside_allocator(CALIBRATION)
    for c in report["checks"]:
        label = f"{c['edition']} tp {c['tp']} {c['gpu_memory_gb']} GB, {c['what']}"
        assert abs(c["error_own"]) <= PUBLISHED_RTOL, (label, c)
        # With the defaults (calibrated on SC25), a figure may miss by more only where its
        # edition's own out-of-memory message shows its software held > 1 GiB more or less
        # outside the allocator (SC24: 7.73 GiB against SC25's 6.56).
        oom = next(p for p in PUBLISHED if p.kind == "oom" and p.edition == c["edition"])
        if abs(outside_allocator(oom) - default) <= 1.0:
            assert abs(c["error"]) <= PUBLISHED_RTOL, (label, c)


def test_a_bad_gpu_count_is_one_error_line() -> None:
    proc = _run(["bench.memory_plan", "--config", "tiny", "--gpus", "0"], 120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: --gpus 0") and proc.stderr.count("\n") == 1
