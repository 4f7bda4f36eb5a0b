"""What a step loses beyond compute and communication (planning/scaling_terms.py), and weak
scaling printed as a range with every term named:

  - the loader: no workers add its read to the step; workers and DALI hide it behind the
    compute (the PyTorch loader's copy still runs on the compute's stream);
  - stragglers: the expected slowest of N ranks grows with N (Blom's approximation, close
    to the exact values);
  - the file system's share per node shrinks with the job's nodes: a large enough job is
    input-bound at the low end;
  - `scaling_rows` (what `bench.dry_run --scaling` prints) gives each GPU count a range,
    low end below the high end, the terms named, and at 1,024 GPUs no bare ~100 %.
"""

from __future__ import annotations

import pytest
from helpers import CONFIG_FILE

from planning.fake_world import runs_collectives_on_fake_tensors
from planning.machines import GPUS, NETWORKS
from planning.predict import scaling_rows
from planning.rates import default_rates
from planning.scaling_terms import (
    expected_max_normal,
    input_bound_step,
    loader_s,
    sample_bytes,
    weak_scaling_step,
)
from planning.time_model import TimeModel
from utils.config import read_config

RATES = default_rates(GPUS["a100-40gb"])


def _short(**flags):
    return read_config(CONFIG_FILE, "short", environ={}).replace(**flags)


def test_a_sample_is_the_tutorials_input_and_target_fields() -> None:
    assert sample_bytes(_short()) == 2 * 20 * 360 * 720 * 4  # 41.5 MB


@pytest.mark.parametrize("loader, workers, expected", [
    ("pytorch", 0, "load + copy + compute"),
    ("pytorch", 4, "max(compute, load / 4) + copy"),
    ("dali", 8, "max(compute, load / 8)"),
])
def test_the_loader_hides_behind_the_compute_only_with_workers(loader, workers, expected
                                                                ) -> None:
    cfg = _short(data_loader_config=loader, num_data_workers=workers)
    load = loader_s(cfg, 16, RATES)
    copy = 16 * sample_bytes(cfg) / RATES.h2d_bytes_per_s
    for compute in (0.01, 1.0):
        got = input_bound_step(compute, cfg, 16, RATES)
        want = eval(expected, {"load": load, "copy": copy, "compute": compute, "max": max})
        assert got == pytest.approx(want)
    # a fast step waits for a lone worker's reads; workers in parallel take 1/w of it
    assert input_bound_step(0.0, _short(num_data_workers=1), 16, RATES) > \
        input_bound_step(0.0, _short(num_data_workers=4), 16, RATES)


def test_the_slowest_of_n_ranks_grows_with_n() -> None:
    assert expected_max_normal(1) == 0.0
    # exact: 1/sqrt(pi) for 2, 1.0294 for 4, 1.5388 for 10 (tables of normal order
    # statistics); Blom's approximation is within 0.03 of them
    assert expected_max_normal(2) == pytest.approx(0.5642, abs=0.03)
    assert expected_max_normal(4) == pytest.approx(1.0294, abs=0.03)
    assert expected_max_normal(10) == pytest.approx(1.5388, abs=0.03)
    values = [expected_max_normal(n) for n in (4, 16, 64, 256, 1024)]
    assert values == sorted(values)


def test_a_large_job_reads_more_than_its_share_of_the_file_system() -> None:
    cfg = _short()
    small_high, small_low = weak_scaling_step(0.3, cfg, 16, 4, 4, 4)
    big_high, big_low = weak_scaling_step(0.3, cfg, 16, 1024, 4, 1024)
    assert small_high.input_s == small_low.input_s == 0.0
    assert big_high.input_s == 0.0 < big_low.input_s  # a quarter of 5 TB/s over 256 nodes
    for end in (small_high, small_low, big_high, big_low):
        assert end.total_s == pytest.approx(end.step_s + end.input_s + end.straggler_s +
                                            end.epoch_s)
    assert big_low.straggler_s > small_low.straggler_s > small_high.straggler_s > 0


@pytest.mark.skipif(not runs_collectives_on_fake_tensors(),
                    reason="this PyTorch has no fake kernels for the c10d collectives")
def test_weak_scaling_is_a_range_with_its_terms_named() -> None:
    cfg = read_config(CONFIG_FILE, "tiny", environ={})
    model = TimeModel(GPUS["a100-40gb"], NETWORKS["perlmutter"])
    rows = scaling_rows(cfg, [4, 1024], 4, model, local_batch=4)
    for r in rows:
        low, high = r["samples_per_s_range"]
        assert 0 < low <= high <= r["samples_per_s"] * 1.0001
        for end in ("high", "low"):
            assert set(r["terms"][end]) == {"step_s", "input_s", "straggler_s", "epoch_s"}
        elo, ehi = r["scaling_efficiency_range"]
        assert elo <= ehi
    assert rows[0]["scaling_efficiency_range"] == pytest.approx((1.0, 1.0))
    elo, ehi = rows[-1]["scaling_efficiency_range"]
    assert elo < 0.95 and elo < ehi  # not a bare ~100 %
    straggling = [r["terms"]["low"]["straggler_s"] for r in rows]
    assert straggling == sorted(straggling)
