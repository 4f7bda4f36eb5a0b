"""An ensemble run end to end (train.py, `tiny_ens`: 4 members, the crps loss): it trains on
one process, and its checkpoint resumes on two processes that split the members
(`--ensemble_parallel_size 2`, torchrun): the ensemble's tensors are the same on every ens
rank and its noise is keyed by the iteration, not drawn from a saved random state, so the
resumed run ends where the uninterrupted one ends (losses, validation's spread, parameters
and Adam's moments, within the tolerances of resumes in other layouts: helpers.CPU_FP32).

And a stock config made an ensemble by flags, as docs/ensembles.md writes the commands:
`torchrun --nproc_per_node 2 train_mp.py --config=tiny --ensemble_size 4 --loss crps
--ensemble_parallel_size 2` trains (every stock config's rank order names ens), and
`inference.py --config=tiny --ensemble_size 4` evaluates it by its config's name (its
model's shape from the checkpoint), its ensemble's scores in skill.json.
"""

from __future__ import annotations

import json
import re

import pytest
from helpers import (
    CPU_FP32,
    assert_completed,
    final_checkpoint,
    losses,
    max_param_difference,
    run_script,
)

pytestmark = pytest.mark.e2e

ARGS = ["--config=tiny_ens", "--num_iters=8", "--checkpoint_interval=4"]


def _spread(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"Ensemble of 4: spread\(u10m\)=([\d.]+) m/s", out)]


def test_an_ensemble_resumes_with_its_members_split_over_two_ranks(run_train):
    ref = run_train("train.py", ARGS)
    assert_completed(ref, 8, epochs=1)
    assert "Ensemble: 4 members per initial condition (all on this rank)" in ref.stdout
    ckpt4 = ref.exp_dir("tiny_ens") / "checkpoints" / "ckpt_00000004.pt"
    run = run_train("train.py", [*ARGS, "--ensemble_parallel_size=2", f"--resume={ckpt4}"],
                    nproc=2)
    assert_completed(run, 8, epochs=1)
    assert "Layout: DP = 1, TP = 1, CP = 1, ENS = 2 (order tp-cp-h-w-ens-dp)" in run.stdout
    assert "members 0-1 on this rank, the others on its 1 ens peer(s)" in run.stdout
    assert f"Resumed from {ckpt4}: iteration 4" in run.stdout
    got, want = losses(run), losses(ref)
    for key in ("train", "val"):
        assert got[key] == pytest.approx(want[key], rel=CPU_FP32.loss_rtol), (key, got, want)
    assert _spread(run.stdout)[-1] == pytest.approx(_spread(ref.stdout)[-1], rel=1e-3)
    a = final_checkpoint(run.exp_dir("tiny_ens", 2), 8)
    b = final_checkpoint(ref.exp_dir("tiny_ens"), 8)
    assert max_param_difference(a, b) <= CPU_FP32.param_atol
    for name, state in b["optimizer"]["state"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            want_m, got_m = state[moment], a["optimizer"]["state"][name][moment]
            err = (got_m - want_m).abs().max().item()
            assert err <= CPU_FP32.moment_rtol * want_m.abs().max().item(), (name, moment)


def test_a_stock_config_made_an_ensemble_by_flags_trains_on_ens_ranks_and_evaluates_by_name(
        run_train, tmp_path):
    flags = ["--config=tiny", "--ensemble_size", "4", "--loss", "crps"]
    run = run_train("train_mp.py", [*flags, "--ensemble_parallel_size", "2", "--num_iters=4"],
                    nproc=2)
    assert_completed(run, 4)
    assert "Layout: DP = 1, TP = 1, CP = 1, ENS = 2 (order tp-cp-h-w-ens-dp)" in run.stdout
    out = tmp_path / "forecast"
    result = run_script("inference.py", ["--config=tiny", "--ensemble_size", "4",
                                         "--lead_steps=2", "--n_initial_conditions=2",
                                         f"--out={out}"],
                        data_dir=run.data_dir, log_dir=run.log_dir, timeout=240)
    assert result.returncode == 0, result.output[-3000:]
    said = next(line for line in result.stdout.splitlines() if "config tiny with" in line)
    assert "its run's flags" in said and "--ensemble_size 4" in said and "--loss crps" in said
    assert "Ensemble of 4: the checkpoint's noise-conditioned members" in result.stdout
    skill = json.loads((out / "skill.json").read_text())
    assert skill["ensemble_size"] == 4 and skill["config"] == "tiny"
    assert len(skill["channels"]["z500"]["crps"]["ensemble"]) == 3  # leads 0, 6 and 12 h
