"""evaluation/forecast_skill.py and networks/rollout.py against independent computations.

The reference scores below are plain Python loops over initial conditions, leads, channels
and grid points, in float64, on de-normalised (physical) fields, with WeatherBench-2's
latitude weights written out (helpers.reference_scores): no torch, no vectorised
reductions. The torch code works in fp32 on normalised fields; on O(1) random data the two
agree to rtol 1e-5 (fp32 sums of a few hundred terms).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import lat_weights, reference_scores, run_distributed

from data.grid import tutorial_grid
from evaluation.forecast_skill import (
    CSV_COLUMNS,
    FORECASTS,
    Skill,
    bad_leads_before,
    crossing_lead,
    crossings,
    describe_crossings,
    dump_json,
    forecast_sums,
    format_table,
    read_json,
    skill_from_sums,
    skill_to_dict,
    table_leads,
    write_csv,
)
from evaluation.regions import region_weights
from networks.rollout import rollout

B, L, C, H, W = 5, 4, 3, 7, 10  # odd H: one row on the equator
NAMES = ["u10", "t2m", "z500"]
MEANS = np.array([1.0, 280.0, 5.5e4])
STDS = np.array([5.0, 20.0, 3.0e3])
RTOL = 1e-5
GRID = tutorial_grid(H, W)  # rows at 90, 60, ..., -90: every region has rows
REGIONS, WEIGHTS = region_weights(GRID)
LAT = list(GRID.latitude)


@pytest.fixture(scope="module")
def rollout_data():
    """Normalised truth, a model forecast that drifts away from it, a climatology that
    changes with the valid time and a time mean."""
    rng = np.random.default_rng(0)
    truth = rng.standard_normal((B, L + 1, C, H, W)).astype(np.float32)
    noise = rng.standard_normal((B, L + 1, C, H, W)).astype(np.float32)
    drift = np.arange(L + 1, dtype=np.float32)[None, :, None, None, None] * 0.3
    forecast = truth + drift * noise  # lead 0: the initial state itself
    clim = (0.3 * rng.standard_normal((B, L + 1, C, H, W))).astype(np.float32)
    time_mean = (0.2 * rng.standard_normal((1, 1, C, H, W))).astype(np.float32)
    return truth, forecast, clim, time_mean


def physical(x: np.ndarray) -> np.ndarray:
    """Normalised (..., C, H, W) -> physical units, in float64."""
    return x.astype(np.float64) * STDS[:, None, None] + MEANS[:, None, None]


def sums_of(forecast, truth, clim, time_mean, part=slice(None)) -> torch.Tensor:
    return forecast_sums(*(torch.from_numpy(np.ascontiguousarray(x[part]))
                           for x in (forecast, truth, clim)), torch.from_numpy(time_mean),
                         torch.from_numpy(WEIGHTS).float())


def torch_skill(forecast: np.ndarray, truth: np.ndarray, clim: np.ndarray,
                time_mean: np.ndarray) -> Skill:
    sums = sums_of(forecast, truth, clim, time_mean)
    assert sums.shape == (4, 2, len(REGIONS), L + 1, C) and sums.dtype == torch.float64
    return skill_from_sums(sums, B, STDS, [6 * k for k in range(L + 1)], NAMES, REGIONS)


def reference(pred, truth, clim, region="global"):
    """Loop scores of physical fields over the rows of `region` (every column), weighted by
    the whole grid's cell areas (WeatherBench-2 restricts the global weights to a band)."""
    rows = WEIGHTS[REGIONS.index(region)] > 0
    weights = [w for w, r in zip(lat_weights(LAT), rows, strict=True) if r]
    p, t, c = (physical(x)[..., rows, :] for x in (pred, truth, clim))
    return reference_scores(p, t, c, weights=weights)


def test_model_scores_match_a_loop_over_every_grid_point(rollout_data):
    truth, forecast, clim, time_mean = rollout_data
    skill = torch_skill(forecast, truth, clim, time_mean)
    rmse, acc = reference(forecast, truth, clim)
    np.testing.assert_allclose(skill.rmse[0, 0], rmse, rtol=RTOL)
    np.testing.assert_allclose(skill.acc[0, 0], acc, rtol=RTOL, atol=1e-6)
    assert skill.rmse[0, 0, 0].tolist() == [0.0] * C  # lead 0 is the initial state
    np.testing.assert_allclose(skill.acc[0, 0, 0], 1.0, atol=1e-6)
    assert (np.diff(skill.rmse[0, 0], axis=0) > 0).all()  # the drift grows with lead


@pytest.mark.parametrize("region", ["northern-hemisphere", "tropics", "southern-hemisphere"])
def test_regional_scores_match_a_loop_over_the_regions_grid_points(rollout_data, region):
    truth, forecast, clim, time_mean = rollout_data
    skill = torch_skill(forecast, truth, clim, time_mean)
    r = REGIONS.index(region)
    rmse, acc = reference(forecast, truth, clim, region)
    np.testing.assert_allclose(skill.rmse[0, r], rmse, rtol=RTOL)
    np.testing.assert_allclose(skill.acc[0, r], acc, rtol=RTOL, atol=1e-6)
    np.testing.assert_array_equal(skill.series("rmse", "model", "t2m", region),
                                  skill.rmse[0, r, :, 1])


def test_persistence_is_the_initial_state_at_every_lead(rollout_data):
    truth, _, clim, time_mean = rollout_data
    persistence = np.repeat(truth[:, :1], L + 1, axis=1)
    skill = torch_skill(truth, truth, clim, time_mean)  # the baselines do not use the model
    rmse, acc = reference(persistence, truth, clim)
    np.testing.assert_allclose(skill.rmse[1, 0], rmse, rtol=RTOL)
    np.testing.assert_allclose(skill.acc[1, 0], acc, rtol=RTOL, atol=1e-6)
    # A model that forecasts "no change" scores exactly like persistence.
    same = torch_skill(persistence, truth, clim, time_mean)
    assert np.array_equal(same.rmse[0], same.rmse[1]) and np.array_equal(same.acc[0], same.acc[1])


def test_climatology_is_the_one_of_each_valid_time_and_its_acc_is_zero(rollout_data):
    truth, _, clim, time_mean = rollout_data
    skill = torch_skill(truth, truth, clim, time_mean)
    rmse, _ = reference(clim, truth, clim)
    np.testing.assert_allclose(skill.rmse[2, 0], rmse, rtol=RTOL)
    assert skill.acc[2].tolist() == [[[0.0] * C] * (L + 1)] * len(REGIONS)
    same = torch_skill(clim, truth, clim, time_mean)
    assert np.array_equal(same.rmse[0], same.rmse[2])


def test_time_mean_is_one_field_at_every_lead_scored_against_the_climatology(rollout_data):
    truth, _, clim, time_mean = rollout_data
    skill = torch_skill(truth, truth, clim, time_mean)
    as_forecast = np.broadcast_to(time_mean, truth.shape)
    rmse, acc = reference(as_forecast, truth, clim)
    np.testing.assert_allclose(skill.rmse[3, 0], rmse, rtol=RTOL)
    np.testing.assert_allclose(skill.acc[3, 0], acc, rtol=RTOL, atol=1e-6)


def test_sums_of_chunks_add_up_to_the_scores_of_the_whole(rollout_data):
    truth, forecast, clim, time_mean = rollout_data
    parts = [sums_of(forecast, truth, clim, time_mean, s) for s in (slice(0, 2), slice(2, B))]
    whole = sums_of(forecast, truth, clim, time_mean)
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-12, atol=1e-12)


def _data_parallel_scores(truth, forecast, clim, time_mean):
    """On each rank: this dp rank's chunk of the initial conditions (inference.py's split),
    its sums, all-reduced over dp."""
    from distributed import comm
    from evaluation import forecast_loop

    comm.init()
    ics = list(range(B))
    mine = forecast_loop.my_initial_conditions(ics)
    sums = sums_of(forecast, truth, clim, time_mean, mine)
    comm.sum_over(sums, "dp")
    return mine, skill_from_sums(sums, B, STDS, list(range(L + 1)), NAMES, REGIONS).rmse


@pytest.mark.distributed
def test_data_parallel_ranks_split_the_initial_conditions_and_reduce_to_the_serial_scores(
        rollout_data):
    results = run_distributed(_data_parallel_scores, 2, *rollout_data)
    assert [r[0] for r in results] == [[0, 1, 2], [3, 4]]  # contiguous, bigger chunk first
    truth, forecast, clim, time_mean = rollout_data
    serial = torch_skill(forecast, truth, clim, time_mean).rmse
    for _, rmse in results:
        np.testing.assert_allclose(rmse, serial, rtol=1e-12)


# ------------------------------------------------------------------ crossings
HOURS = [0, 6, 12, 18, 24]


def test_crossing_is_interpolated_between_the_last_good_lead_and_the_next():
    # model minus baseline: -1 at 6 h, +3 at 12 h -> zero a quarter of the way: 7.5 h
    assert crossing_lead(HOURS, [0.0, -1.0, 3.0, 4.0, 5.0]) == 7.5
    assert crossing_lead(HOURS, [-0.4, -0.2, 0.0, 0.1, 0.2]) == 12.0  # a tie is no longer good


def test_a_forecast_good_at_the_last_lead_never_crosses():
    assert crossing_lead(HOURS, [0.0, -1.0, -2.0, -3.0, -0.1]) is None


def test_a_forecast_never_better_than_persistence_crosses_at_lead_0():
    # persistence: both errors are 0 at lead 0, the model is worse from the first step on
    assert crossing_lead(HOURS, [0.0, 1.0, 2.0, 3.0, 4.0]) == 0.0


def test_the_crossing_is_the_last_one_and_earlier_bad_leads_are_reported():
    gap = [0.0, 0.5, -1.0, -1.0, 1.0]  # worse at 6 h, better at 12-18 h, worse at 24 h
    assert crossing_lead(HOURS, gap) == 21.0
    assert bad_leads_before(HOURS, gap, 21.0) == [6.0]
    gap = [0.0, 0.5, -1.0, -1.0, -1.0]  # better from 12 h to the end
    assert crossing_lead(HOURS, gap) is None
    assert bad_leads_before(HOURS, gap, None) == [6.0]


def test_a_nan_forecast_counts_as_bad_from_its_lead():
    assert crossing_lead(HOURS, [-1.0, -1.0, -1.0, float("nan"), float("nan")]) == 18.0


def skill_from_series(model_rmse, persistence_rmse, climatology_rmse, model_acc) -> Skill:
    rmse = np.array([model_rmse, persistence_rmse, climatology_rmse, climatology_rmse],
                    dtype=float)[:, None, :, None]
    acc = np.zeros_like(rmse)
    acc[0, 0, :, 0] = model_acc
    return Skill(HOURS, ["z500"], rmse, acc, n_initial_conditions=3, regions=["global"])


def test_crossings_of_a_skill_against_both_baselines_and_the_useful_acc():
    skill = skill_from_series(model_rmse=[0, 1, 2, 4, 6], persistence_rmse=[0, 2, 3, 4, 5],
                              climatology_rmse=[5, 5, 5, 5, 5], model_acc=[1, .9, .8, .5, .3])
    assert crossings(skill, "z500") == pytest.approx({"rmse_above_persistence_h": 18.0,
                                                      "rmse_above_climatology_h": 21.0,
                                                      "acc_below_0.6_h": 16.0})
    assert describe_crossings(skill, "z500") == (
        "z500: model RMSE above persistence from 18.0 h on; RMSE above climatology from "
        "21.0 h on; ACC below 0.6 from 16.0 h on")


def test_a_skilful_forecast_is_described_as_never_crossing():
    skill = skill_from_series(model_rmse=[0, 1, 2, 2, 2], persistence_rmse=[0, 0.5, 3, 4, 5],
                              climatology_rmse=[5, 5, 5, 5, 5], model_acc=[1, 1, 1, 1, 1])
    line = describe_crossings(skill, "z500")
    assert "RMSE above persistence only at 6 h" in line
    assert "RMSE above climatology at no lead up to 24 h" in line


# ------------------------------------------------------------------ reports
def test_csv_and_json_hold_every_region_channel_and_lead(rollout_data, tmp_path):
    truth, forecast, clim, time_mean = rollout_data
    skill = torch_skill(forecast, truth, clim, time_mean)
    write_csv(skill, tmp_path / "skill.csv")
    rows = (tmp_path / "skill.csv").read_text().splitlines()
    assert rows[0].split(",") == list(CSV_COLUMNS)
    assert len(rows) == 1 + len(REGIONS) * C * (L + 1)
    row = 1 + 2 * C * (L + 1) + 2 * (L + 1) + 3  # tropics, z500, lead 3
    region, name, variable, level, units, step, hours, *scores = rows[row].split(",")
    assert (region, name, variable, level, units, step, hours) == (
        "tropics", "z500", "geopotential", "500", "m**2 s**-2", "3", "18")
    expected = [getattr(skill, m)[f, 2, 3, 2] for m in ("rmse", "acc") for f in range(4)]
    np.testing.assert_allclose([float(s) for s in scores], expected, rtol=1e-8)
    assert rows[1].split(",")[:4] == ["global", "u10", "10m_u_component_of_wind", ""]

    dump_json(skill_to_dict(skill, {"config": "test"}), tmp_path / "skill.json")
    data = json.loads((tmp_path / "skill.json").read_text())
    assert data["regions"] == REGIONS and data["channels"]["t2m"]["variable"] == "2m_temperature"
    assert data["channels"]["z500"]["level"] == 500
    assert data["channels"]["z500"]["rmse"]["model"] == \
        data["channels"]["z500"]["regions"]["global"]["rmse"]["model"]
    back = read_json(tmp_path / "skill.json")
    assert back.channels == NAMES and back.lead_hours == skill.lead_hours
    assert back.regions == REGIONS and back.climatology == skill.climatology
    np.testing.assert_array_equal(back.rmse, skill.rmse)
    np.testing.assert_array_equal(back.acc, skill.acc)
    assert list(FORECASTS) == ["model", "persistence", "climatology", "time_mean"]


def test_the_table_shows_the_first_step_then_every_day():
    assert table_leads(21) == [1, 4, 8, 12, 16, 20]
    assert table_leads(4) == [1, 3]
    assert table_leads(2) == [1]


def test_the_table_has_one_row_per_lead_with_the_units(rollout_data):
    lines = format_table(torch_skill(*rollout_data[1::-1], *rollout_data[2:]), "z500")
    assert "[m**2 s**-2]" in lines[0] and len(lines) == 2 + len(table_leads(L + 1))
    assert lines[2].startswith("| 6 h |")


# ------------------------------------------------------------------ rollout
def test_rollout_feeds_each_prediction_back_as_the_next_input():
    torch.manual_seed(0)
    model = torch.nn.Conv2d(C, C, 3, padding=1)
    x0 = torch.randn(2, C, H, W)
    with torch.no_grad():
        got = rollout(model, x0, 3)
        x1 = model(x0)
        x2 = model(x1)
        x3 = model(x2)
    assert got.shape == (2, 3, C, H, W)
    for k, expected in enumerate((x1, x2, x3)):
        torch.testing.assert_close(got[:, k], expected, rtol=0, atol=0)


def test_rollout_carries_fp32_state_under_autocast_and_is_differentiable():
    torch.manual_seed(0)
    model = torch.nn.Conv2d(C, C, 3, padding=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        preds = rollout(model, torch.randn(2, C, H, W), 2)
    assert preds.dtype == torch.float32
    preds[:, -1].square().mean().backward()  # a multi-step loss trains through every step
    assert model.weight.grad is not None and model.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="at least one step"):
        rollout(model, torch.randn(1, C, H, W), 0)

