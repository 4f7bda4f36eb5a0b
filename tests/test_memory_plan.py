"""The memory planner (bench/memory_plan.py, planning/memory.py) against real runs.

  - On 4 CPU ranks (gloo, torchrun), bench.bench_memory runs every layout the planner lists
    for a small ViT (dp, tp, cp and their products; DDP and FSDP; recompute or not) and a
    small AFNO (h x w meshes), two steps each, and measures rank 0's peak of allocated
    tensor bytes with the profiler's allocation events (not the resident set size; the
    least of three runs, bench/bench_memory.py says why): the planner's estimate of each,
    traced on fake tensors with the CPU's kernels, is within PEAK_RTOL of it.
  - The planner's command line: `--json` prints one object per layout with the keys the
    docs promise, `fits` says whether the peak fits the GPU, one layout that fits is the
    fastest, and a bad value is one `error:` line, exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CONFIG_FILE, REPO, child_env

pytestmark = pytest.mark.e2e

PEAK_RTOL = 0.15
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
        assert r["fits"] == (r["peak_gb"] <= 40) and 0 < r["after_forward_gb"] < r["peak_gb"]
        parts = sum(r[f"{p}_gb"] for p in ("parameters", "gradients", "optimizer",
                                           "activations", "communication"))
        assert r["peak_gb"] == pytest.approx(parts + r["allowance_gb"])
    fastest = [r for r in rows if r["fastest"]]
    # the rule: no model parallelism, no recompute, DDP before FSDP, when it fits
    assert [(r["dp"], r["fsdp"], r["activation_checkpointing"]) for r in fastest] == [
        (2, False, "none")]


def test_a_bad_gpu_count_is_one_error_line() -> None:
    proc = _run(["bench.memory_plan", "--config", "tiny", "--gpus", "0"], 120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: --gpus 0") and proc.stderr.count("\n") == 1
