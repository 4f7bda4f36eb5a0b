"""inference.py on ensembles (evaluation/ensemble_evaluation.py, ensemble_members.py): an
ensemble checkpoint (`tiny_ens`, 8 iterations) and a deterministic one (`tiny`, 8
iterations) trained on a tiny forced planet, evaluated end to end.

  - the ensemble's scores sit beside the perfect-model ensemble, the deterministic model,
    persistence and climatology; its rank histograms sum to 1 and leave out lead 0;
  - the members saved with --save_forecasts (a `realization` dimension) and the truth saved
    with --save_truth give, scored with xarray as WeatherBench-2 defines its metrics
    (CRPS = mean |X - y| - mean over distinct pairs |X - X'| / 2; ensemble-mean RMSE = the
    root of the mean over initial times of the area-weighted mean squared error of the
    members' mean), the CRPS and ensemble-mean RMSE of ensemble_skill.csv: rtol 1e-4 (float32
    fields on both sides, summed in another order);
  - the deterministic checkpoint's members start from perturbed initial conditions (said in
    the log) and its unperturbed forecast is the deterministic column, the same as when it
    stands beside the ensemble (--deterministic);
  - skill.json and TensorBoard hold the ensemble's scores beside the deterministic ones:
    the CRPS of every forecast, ensemble-mean RMSE, spread, spread/skill and the rank
    histograms' flatness, by channel, region and lead, as ensemble_skill.csv and
    rank_histograms.csv have them;
  - on two ranks, splitting the initial conditions (dp) or the model (tp), and an AFNO
    ensemble's grid over h or w (its spatial mesh), every score and rank histogram equals
    the serial evaluation's;
  - what does not fit is one line, exit code 2.
And in-process: scores added lead by lead and batch by batch (as inference.py adds them)
equal those of whole rollouts, a single forecast's CRPS is its MAE, and a perfect ensemble's
rank histogram is flat (its flatness near 1, a U's and a spike's below).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
from helpers import assert_one_error_line, lat_weights, one_line, run_script

from data.grid import tutorial_grid
from data.synthetic import generate
from evaluation.ensemble_evaluation import EnsembleReport, EnsembleSums
from evaluation.ensemble_scores import SCORES, ensemble_sums, rank_histogram_sums
from evaluation.inference_flags import parse_flags
from evaluation.regions import region_weights
from utils.errors import ConfigError

LEAD, N_ICS, TIMEOUT = 3, 4, 240
CHECKED = {"u10": ("10m_u_component_of_wind", None), "t2m": ("2m_temperature", None),
           "z500": ("geopotential", 500)}
AFNO_ENSEMBLE = ["--config=tiny_afno", "--ensemble_size=4", "--loss=crps"]


@pytest.fixture(scope="module")
def forced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 x 32, 24 samples per year (1 + 1 + 1 years), forcing 100 m2/s2, 5-day spin-up."""
    out = tmp_path_factory.mktemp("forced")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("data.planet._SPINUP_DAYS", 5.0)
        generate(out, img_size=(16, 32), samples_per_year=24, train_years=1, valid_years=1,
                 test_years=1, forcing=100.0)
    return out


@pytest.fixture(scope="module")
def runs(forced: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The two checkpoints: {'ens': ..., 'det': ...}, and the log directory."""
    log_dir = tmp_path_factory.mktemp("logs")
    out = {"log_dir": log_dir}
    for key, config in (("ens", "tiny_ens"), ("det", "tiny")):
        run = run_script("train.py", [f"--config={config}", "--num_iters=8"], data_dir=forced,
                         log_dir=log_dir, timeout=TIMEOUT)
        assert run.returncode == 0, run.output[-3000:]
        out[key] = run.exp_dir(config) / "checkpoints" / "ckpt_00000008.pt"
    return out


@pytest.fixture(scope="module")
def afno(runs: dict[str, Path], forced: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An AFNO ensemble (tiny_afno made one by flags, 8 iterations) evaluated serially:
    its output directory."""
    run = run_script("train.py", [*AFNO_ENSEMBLE, "--num_iters=8"], data_dir=forced,
                     log_dir=runs["log_dir"], timeout=TIMEOUT)
    assert run.returncode == 0, run.output[-3000:]
    runs["afno"] = run.exp_dir("tiny_afno") / "checkpoints" / "ckpt_00000008.pt"
    out = tmp_path_factory.mktemp("afno_serial")
    result = infer(runs, forced, f"--checkpoint={runs['afno']}", f"--out={out}")
    assert result.returncode == 0, result.output[-3000:]
    return out


def infer(runs: dict[str, Path], forced: Path, *flags: str):
    return run_script("inference.py", [f"--lead_steps={LEAD}", f"--n_initial_conditions={N_ICS}",
                                       "--batch_size=3", *flags],
                      data_dir=forced, log_dir=runs["log_dir"], timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ensemble(runs: dict[str, Path], forced: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("ens_forecast")
    result = infer(runs, forced, f"--checkpoint={runs['ens']}", f"--deterministic={runs['det']}",
                   f"--out={out}", f"--save_forecasts={out / 'f.zarr'}",
                   f"--save_truth={out / 't.zarr'}")
    assert result.returncode == 0, result.output[-3000:]
    return result, out


def rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def column(table: list[dict[str, str]], name: str, channel: str, region: str = "global"
           ) -> np.ndarray:
    return np.array([float(r[name]) for r in table
                     if r["channel"] == channel and r["region"] == region])


@pytest.mark.e2e
def test_an_ensemble_is_scored_beside_every_reference(ensemble) -> None:
    result, out = ensemble
    for name in ("ensemble_skill.csv", "rank_histograms.csv", "crps_vs_lead.png",
                 "spread_skill.png", "rank_histograms.png", "skill.csv", "inference.log"):
        assert (out / name).is_file(), name
    log = result.stdout
    assert "Ensemble of 4: the checkpoint's noise-conditioned members" in log
    assert "Perfect-model ensemble of 4: the planet branched" in log
    assert "Rank histograms: lead 0 left out" in log
    assert "| u10 lead | CRPS ensemble | CRPS perfect_model | CRPS deterministic |" in log
    table = rows(out / "ensemble_skill.csv")
    for name in ("crps_ensemble", "crps_perfect_model", "crps_deterministic",
                 "crps_persistence", "crps_climatology", "spread_skill_ratio_ensemble",
                 "spread_skill_ratio_corrected_ensemble"):
        assert np.isfinite(column(table, name, "u10")[1:]).all(), name
    assert column(table, "crps_persistence", "u10")[0] == 0  # lead 0: the truth itself
    plain = column(table, "spread_skill_ratio_ensemble", "u10")[1:]
    corrected = column(table, "spread_skill_ratio_corrected_ensemble", "u10")[1:]
    np.testing.assert_allclose(corrected, plain * math.sqrt(5 / 4), rtol=1e-6)
    hist = rows(out / "rank_histograms.csv")
    assert {r["lead_step"] for r in hist} == {str(k) for k in range(1, LEAD + 1)}
    assert {r["forecast"] for r in hist} == {"ensemble", "perfect_model"}
    for r in hist:
        assert sum(float(r[f"rank_{i}"]) for i in range(5)) == pytest.approx(1, abs=1e-5)


def _entropy(row: dict[str, str], E: int = 4) -> float:
    """A rank histogram's flatness, written out: its entropy over that of a flat one."""
    p = np.array([float(row[f"rank_{i}"]) for i in range(E + 1)])
    p = p[p > 0]
    return float(-(p * np.log(p)).sum() / np.log(E + 1))


@pytest.mark.e2e
def test_skill_json_and_tensorboard_hold_the_ensembles_scores_beside_the_others(ensemble):
    """skill.json: under every channel (global) and each region, {score: {forecast: [by
    lead]}} as ensemble_skill.csv holds them (undefined values null), the rank histograms'
    flatness from rank_histograms.csv; TensorBoard: the same scores in each forecast's
    event directory, beside the deterministic RMSE and ACC (of the ensemble mean)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out = ensemble
    data = json.loads((out / "skill.json").read_text())
    assert data["ensemble_size"] == 4
    table, hist = rows(out / "ensemble_skill.csv"), rows(out / "rank_histograms.csv")
    for channel in CHECKED:
        entry = data["channels"][channel]
        assert set(entry["rmse"]) == {"model", "persistence", "climatology", "time_mean"}
        for region in ("global", "tropics"):
            scores = entry["regions"][region]
            for forecast in ("ensemble", "perfect_model"):
                for score in SCORES:
                    got = np.array(scores[score][forecast], dtype=float)  # null: NaN
                    np.testing.assert_allclose(
                        got, column(table, f"{score}_{forecast}", channel, region), rtol=1e-6,
                        err_msg=f"{channel} {region} {score} {forecast}")
                flatness = scores["rank_histogram_flatness"][forecast]
                want = [_entropy(r) for r in hist if (r["forecast"], r["region"],
                                                      r["channel"]) == (forecast, region, channel)]
                assert flatness[0] is None  # lead 0 has no histogram
                np.testing.assert_allclose(flatness[1:], want, rtol=1e-4)
            for single in ("deterministic", "persistence", "climatology"):
                np.testing.assert_allclose(scores["crps"][single],
                                           column(table, f"crps_{single}", channel, region),
                                           rtol=1e-6)
        assert entry["crps"] == entry["regions"]["global"]["crps"]
    board = {}
    for forecast in ("model", "ensemble", "perfect_model", "deterministic", "persistence"):
        acc = EventAccumulator(str(out / "tensorboard" / forecast), size_guidance={"scalars": 0})
        board[forecast] = acc.Reload()
    assert "forecast/RMSE(u10)" in board["model"].Tags()["scalars"]
    persistence = set(board["persistence"].Tags()["scalars"])
    assert {"forecast/RMSE(u10)", "forecast/CRPS(u10)"} <= persistence
    for tag, score in (("CRPS", "crps"), ("EnsembleMeanRMSE", "ensemble_mean_rmse"),
                       ("Spread", "spread"), ("SpreadSkill", "spread_skill_ratio"),
                       ("SpreadSkillCorrected", "spread_skill_ratio_corrected"),
                       ("RankHistogramFlatness", "rank_histogram_flatness")):
        for where, region in (("forecast", "global"), ("forecast/tropics", "tropics")):
            events = board["ensemble"].Scalars(f"{where}/{tag}(u10)")
            want = data["channels"]["u10"]["regions"][region][score]["ensemble"]
            assert [e.step for e in events] == [h for h, w in zip(data["lead_hours"], want,
                                                                  strict=True) if w is not None]
            np.testing.assert_allclose([e.value for e in events],
                                       [w for w in want if w is not None], rtol=1e-6)
    crps = [e.value for e in board["deterministic"].Scalars("forecast/CRPS(u10)")]
    np.testing.assert_allclose(crps, data["channels"]["u10"]["crps"]["deterministic"], rtol=1e-6)


def _wb2(forecast: xr.DataArray, truth: xr.DataArray, weights: xr.DataArray
         ) -> tuple[np.ndarray, np.ndarray]:
    """WeatherBench-2's CRPS and ensemble-mean RMSE by lead, written out: pointwise, then
    the area-weighted mean, then the mean over initial times (RMSE: the root last)."""
    E = forecast.sizes["realization"]
    other = forecast.rename(realization="other")
    skill = abs(forecast - truth).mean("realization")
    pairs = abs(forecast - other).sum(["realization", "other"]) / (E * (E - 1))
    crps = skill - 0.5 * pairs
    mse = (forecast.mean("realization") - truth) ** 2

    def area(x):
        return (x * weights).sum(["latitude", "longitude"]) / (
            weights.sum("latitude") * x.sizes["longitude"])

    return (area(crps).mean("time").values,
            np.sqrt(area(mse).mean("time").values))


@pytest.mark.e2e
def test_saved_members_score_as_weatherbench2_scores_them(ensemble) -> None:
    _, out = ensemble
    fc = xr.open_zarr(out / "f.zarr").load()
    tr = xr.open_zarr(out / "t.zarr").load()
    assert fc.sizes["realization"] == 4 and list(fc.realization.values) == [0, 1, 2, 3]
    table = rows(out / "ensemble_skill.csv")
    lat = fc.latitude.values
    for region, inside in (("global", np.ones_like(lat, bool)),
                           ("northern-hemisphere", lat >= 20)):
        w = xr.DataArray(np.where(inside, lat_weights(list(lat)), 0.0), dims="latitude",
                         coords={"latitude": lat})
        for channel, (variable, level) in CHECKED.items():
            f, t = fc[variable], tr[variable]
            if level is not None:
                f, t = f.sel(level=level), t.sel(level=level)
            valid = fc.time + fc.prediction_timedelta  # (time, lead): the truth's times
            truth = t.sel(time=valid)
            crps, rmse = _wb2(f, truth, w)
            # Lead 0 (every member the truth) is 0 there, a rounding error (1e-7) here.
            np.testing.assert_allclose(column(table, "crps_ensemble", channel, region), crps,
                                       rtol=1e-4, atol=1e-6 * crps.max(),
                                       err_msg=f"CRPS {channel} {region}")
            np.testing.assert_allclose(column(table, "ensemble_mean_rmse_ensemble", channel,
                                              region), rmse, rtol=1e-4, atol=1e-6 * rmse.max(),
                                       err_msg=f"ensemble-mean RMSE {channel} {region}")


@pytest.mark.e2e
def test_a_deterministic_checkpoint_gets_members_from_perturbed_initial_conditions(
        runs, forced, ensemble, tmp_path) -> None:
    result = infer(runs, forced, f"--checkpoint={runs['det']}", "--ensemble_size=3",
                   "--ic_perturbation=0.1", f"--out={tmp_path}")
    assert result.returncode == 0, result.output[-3000:]
    assert ("Ensemble of 3 from a deterministic checkpoint: members start from perturbed "
            "initial conditions, x0 + 0.1 x N(0, 1)") in result.stdout
    assert "the deterministic model: the checkpoint's unperturbed forecast" in result.stdout
    table = rows(tmp_path / "ensemble_skill.csv")
    assert column(table, "spread_ensemble", "u10")[0] > 0  # the perturbed starts
    assert column(table, "crps_deterministic", "u10")[0] == 0
    beside = rows(ensemble[1] / "ensemble_skill.csv")  # the same model beside the ensemble
    for channel in CHECKED:
        np.testing.assert_allclose(column(table, "crps_deterministic", channel),
                                   column(beside, "crps_deterministic", channel), rtol=1e-5)


@pytest.mark.e2e
@pytest.mark.distributed
@pytest.mark.parametrize("layout", [[], ["--tp=2"]], ids=["dp2", "tp2"])
def test_an_ensemble_scores_the_same_serially_and_in_parallel(runs, forced, ensemble, layout,
                                                              tmp_path) -> None:
    """Two ranks, splitting the initial conditions (dp) or the model (tp): the same members
    (their noise keyed by the initial time), the same perfect-model ensemble and the same
    tie-breaking draws, so every score and every rank histogram equals the serial run's."""
    result = run_script("inference.py", [f"--lead_steps={LEAD}", f"--n_initial_conditions={N_ICS}",
                                         "--batch_size=3", f"--checkpoint={runs['ens']}",
                                         f"--deterministic={runs['det']}", f"--out={tmp_path}",
                                         *layout],
                        data_dir=forced, log_dir=runs["log_dir"], nproc=2, timeout=TIMEOUT)
    assert result.returncode == 0, result.output[-3000:]
    _assert_same_scores(tmp_path, ensemble[1])


@pytest.mark.e2e
@pytest.mark.distributed
@pytest.mark.parametrize("mesh", ["--h_parallel_size=2", "--w_parallel_size=2"],
                         ids=["h2", "w2"])
def test_an_afno_ensemble_scores_the_same_on_its_spatial_mesh(runs, forced, afno, mesh,
                                                              tmp_path) -> None:
    """An AFNO ensemble on two ranks, each rolling out its tile of the grid (rows on h,
    columns on w) for every member: the members' noise is cut from the whole grid's, the
    scores' and histograms' sums are completed over the mesh and the ties' draws are the
    whole grid's, so every score and rank histogram equals the serial evaluation's."""
    result = run_script("inference.py", [f"--lead_steps={LEAD}", f"--n_initial_conditions={N_ICS}",
                                         "--batch_size=3", f"--checkpoint={runs['afno']}",
                                         f"--out={tmp_path}", mesh],
                        data_dir=forced, log_dir=runs["log_dir"], nproc=2, timeout=TIMEOUT)
    assert result.returncode == 0, result.output[-3000:]
    assert json.loads((tmp_path / "skill.json").read_text())["layout"][mesh[2]] == 2
    _assert_same_scores(tmp_path, afno)


def _assert_same_scores(parallel_dir: Path, serial_dir: Path) -> None:
    """ensemble_skill.csv, rank_histograms.csv and skill.json's scores of a parallel
    evaluation against the serial one's: rtol 1e-5 (sums over ranks in another order)."""
    for name in ("ensemble_skill.csv", "rank_histograms.csv"):
        parallel, serial = rows(parallel_dir / name), rows(serial_dir / name)
        assert len(parallel) == len(serial), name
        for p, s in zip(parallel, serial, strict=True):
            for key, value in s.items():
                try:
                    expected = float(value)
                except ValueError:
                    assert p[key] == value, (name, key)
                    continue
                np.testing.assert_allclose(float(p[key]), expected, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{name} {key} {s['channel']}")
    got, want = (json.loads((d / "skill.json").read_text())["channels"]
                 for d in (parallel_dir, serial_dir))
    for channel, entry in want.items():
        for region, scores in entry["regions"].items():
            for score, by in scores.items():
                for forecast, values in by.items():
                    np.testing.assert_allclose(
                        np.array(got[channel]["regions"][region][score][forecast], dtype=float),
                        np.array(values, dtype=float), rtol=1e-5, atol=1e-6,
                        err_msg=f"skill.json {channel} {region} {score} {forecast}")


@pytest.mark.e2e
def test_what_does_not_fit_an_ensemble_is_one_line(runs, forced) -> None:
    for flags, words in (
            ([f"--checkpoint={runs['ens']}", "--ic_perturbation=0.1"],
             "--ic_perturbation: tiny_ens is an ensemble of 4"),
            ([f"--checkpoint={runs['det']}", "--ic_perturbation=0.1"],
             "tiny is deterministic; its members start from perturbed initial conditions when "
             "--ensemble_size E"),
            ([f"--checkpoint={runs['ens']}", f"--deterministic={runs['ens']}"],
             "an ensemble of 4 (ensemble_size > 1); give a deterministic model's"),
            ([f"--checkpoint={runs['det']}", "--ensemble_size=2", f"--deterministic={runs['det']}"],
             "the checkpoint evaluated is deterministic itself")):
        assert_one_error_line(infer(runs, forced, *flags), [words])


def test_flags_an_ensemble_cannot_be_scored_with_are_one_line() -> None:
    for argv, words in ((["--ensemble_size", "1"], "--ensemble_size 1: an ensemble is scored "
                                                   "with 2 to 64 members"),
                        (["--ensemble_size", "500"], "--ensemble_size 500"),
                        (["--ensemble_size", "4", "--ic_perturbation", "-1"],
                         "a positive perturbation")):
        with pytest.raises(ConfigError) as err:
            parse_flags(argv)
        assert words in one_line(err)


def test_scores_added_lead_by_lead_and_batch_by_batch_equal_whole_rollouts() -> None:
    """What inference.py adds (one lead of one batch at a time) against ensemble_sums and
    rank_histogram_sums of the whole rollouts, and a brute-force MAE; 48 initial conditions
    whose truth is one more draw of the members' distribution: a flat rank histogram."""
    g = torch.Generator().manual_seed(5)
    B, E, L1, C, H, W = 48, 4, 3, 2, 8, 16
    truth = torch.randn(B, L1, C, H, W, generator=g)
    members = torch.randn(B, E, L1, C, H, W, generator=g)
    single = torch.randn(B, L1, C, H, W, generator=g)
    names, weights = region_weights(tutorial_grid(H, W))
    w = torch.from_numpy(weights).float()
    keys = [6 * b for b in range(B)]
    sums = EnsembleSums(len(names), L1, C, E, "cpu")
    for start in range(0, B, 20):
        b = slice(start, start + 20)
        for k in range(L1):
            sums.add(k, truth[b, k], {"ensemble": members[b, :, k], "deterministic": single[b, k]},
                     w, keys[b])
    torch.testing.assert_close(sums.ensembles[0], ensemble_sums(members, truth, w),
                               rtol=1e-6, atol=1e-9)
    whole = rank_histogram_sums(members[:, :, 1:], truth[:, 1:], w, keys, first_lead=1)
    torch.testing.assert_close(sums.ranks[0], whole, rtol=1e-6, atol=1e-9)
    report = sums.skill(B, [2.0, 3.0], [0, 6, 12], ["a", "b"], names)
    for r in range(len(names)):
        mae = ((single - truth).abs().double().mean(dim=(0, -1)) * w[r].double()).mean(-1)
        np.testing.assert_allclose(report.mae["deterministic"][r], mae.numpy() * [2.0, 3.0],
                                   rtol=1e-5)
    hist = report.ranks["ensemble"][0]  # global: (L, C, E + 1)
    np.testing.assert_allclose(hist.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(hist, 1 / (E + 1), atol=0.02)
    assert set(report.ensembles) == {"ensemble"} and set(report.mae) == {"deterministic"}
    flatness = report.flatness("ensemble")  # (R, L+1, C)
    assert np.isnan(flatness[:, 0]).all() and (flatness[0, 1:] > 0.99).all()


def test_a_rank_histograms_flatness_is_1_when_flat_and_lower_for_a_u_or_a_spike() -> None:
    hists = np.array([[0.2] * 5, [0.4, 0.1, 0.0, 0.1, 0.4], [1.0, 0, 0, 0, 0]])
    report = EnsembleReport([0, 6, 12, 18], ["a"], ["global"], 4, 1, {}, {},
                            {"ensemble": hists.reshape(1, 3, 1, 5)})
    flatness = report.flatness("ensemble")[0, :, 0]
    assert np.isnan(flatness[0])
    u = -(0.8 * np.log(0.4) + 0.2 * np.log(0.1)) / np.log(5)
    np.testing.assert_allclose(flatness[1:], [1.0, u, 0.0], atol=1e-12)
