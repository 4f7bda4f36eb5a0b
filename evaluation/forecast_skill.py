"""Forecast skill by lead time and region: latitude-weighted RMSE and ACC of a rollout and
of the baselines every weather model is measured against.

    model        the autoregressive forecast x_k = model(x_{k-1}) from the initial state x_0
    persistence  "nothing changes": the forecast for every lead is x_0
    climatology  "the usual weather for the date and hour": the data set's seasonal and
                 diurnal climatology at each valid time (data/climatology.py)
    time_mean    "the average weather": time_means, one field for every date and hour

ACC measures anomalies against the climatology (so its ACC is 0 by definition, not 0/0);
a data set prepared without a climatology uses time_means for both, and says so in
skill.json ("climatology": "time mean"). Scores are accumulated as sums over initial
conditions (`forecast_sums`), so that data-parallel ranks can add their sums with one
all-reduce before `skill_from_sums` divides (WeatherBench-2's definitions):
    RMSE(region, lead, channel) = std_c * sqrt(mean over ICs of the weighted MSE)
    ACC(region, lead, channel)  = mean over ICs of the weighted anomaly correlation
Fields are normalised; multiplying by the channel's global std gives physical units.
Regions and weights: evaluation/regions.py. A forecast counts as useful while its ACC
stays >= 0.6.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from data.era5_names import channel as channel_info
from data.era5_names import units_of
from evaluation.scores import weighted_acc_channels, weighted_mse_channels
from utils.tile import Tile

FORECASTS = ("model", "persistence", "climatology", "time_mean")
USEFUL_ACC = 0.6


def forecast_sums(forecast: torch.Tensor, truth: torch.Tensor, climatology: torch.Tensor,
                  time_mean: torch.Tensor, weights: torch.Tensor, tile: Tile | None = None,
                  initial: torch.Tensor | None = None) -> torch.Tensor:
    """Sums over a batch of initial conditions, to be added up over batches and ranks.

    forecast, truth: (B, L+1, C, H, W) normalised fields at leads 0..L (forecast[:, 0] is
    the initial state); climatology: its value at each valid time, (B, L+1, C, H, W), or
    one field for all, (1, 1, C, H, W); time_mean: (1, 1, C, H, W); weights: the whole
    grid's region weights (R, H). With a `tile` (spatial parallelism) the fields are this
    rank's tile of the grid, and the sums are those of the whole grid (collectives over
    "h-w"). `initial` (B, 1, C, H, W), persistence's forecast, is truth[:, :1] unless given
    (the leads scored one at a time start after it). Returns float64 (4 forecasts, 2, R,
    L+1, C): [sum of weighted MSE, sum of ACC].
    """
    B, L1, C = truth.shape[:3]
    weights = weights if weights.dim() == 2 else weights[None]
    truth = truth.float()
    clim = climatology.float().expand_as(truth)
    initial = truth[:, :1] if initial is None else initial.float()
    candidates = (forecast.float(), initial.expand_as(truth), clim,
                  time_mean.float().expand_as(truth))
    sums = torch.zeros(len(FORECASTS), 2, len(weights), L1, C, dtype=torch.float64,
                       device=truth.device)
    flat = lambda x: x.reshape(B * L1, *x.shape[2:])  # noqa: E731
    for i, pred in enumerate(candidates):
        mse = weighted_mse_channels(pred, truth, weights, tile)  # (B, L+1, R, C)
        sums[i, 0] = mse.double().sum(0).transpose(0, 1)
        if FORECASTS[i] != "climatology":  # zero anomaly: ACC is 0 by definition
            acc = weighted_acc_channels(flat(pred), flat(truth), flat(clim), weights, tile)
            sums[i, 1] = acc.view(B, L1, *acc.shape[1:]).double().sum(0).transpose(0, 1)
    return sums


@dataclass
class Skill:
    """Scores of every forecast, region, lead and channel; arrays are (4 forecasts,
    R regions, L+1, C)."""

    lead_hours: list[int]
    channels: list[str]
    rmse: np.ndarray  # physical units
    acc: np.ndarray
    n_initial_conditions: int
    regions: list[str]
    climatology: str = "seasonal and diurnal harmonics"

    def index(self, channel: str) -> int:
        return self.channels.index(channel)

    def series(self, metric: str, forecast: str, channel: str, region: str = "global"
               ) -> np.ndarray:
        """Scores by lead time of one forecast, channel and region, e.g. ('rmse', 'model',
        'z500')."""
        return getattr(self, metric)[FORECASTS.index(forecast), self.regions.index(region),
                                     :, self.index(channel)]


def skill_from_sums(sums: torch.Tensor, count: int, stds: Sequence[float],
                    lead_hours: Sequence[int], channels: Sequence[str],
                    regions: Sequence[str], climatology: str = Skill.climatology) -> Skill:
    """Divide the (all-reduced) sums of `forecast_sums` by the number of initial conditions."""
    s = sums.detach().cpu().double().numpy() / count
    stds = np.asarray(stds, dtype=np.float64).reshape(1, 1, 1, -1)
    return Skill(lead_hours=list(lead_hours), channels=list(channels),
                 rmse=np.sqrt(s[:, 0]) * stds, acc=s[:, 1], n_initial_conditions=count,
                 regions=list(regions), climatology=climatology)


# ------------------------------------------------------------------ where skill runs out
def _good(g: float) -> bool:
    return g < 0  # False for NaN: a forecast that produced NaN is not good


def crossing_lead(lead_hours: Sequence[float], gap: Sequence[float]) -> float | None:
    """The lead time (h) from which the forecast stays bad to the end of the rollout,
    linearly interpolated between the last good lead and the next; None if it is still
    good at the last lead. 0 if it is never good after lead 0.

    `gap` < 0 means "good": model RMSE minus the baseline's (below it), or 0.6 minus ACC.
    The last crossing, not the first: an under-trained model can be worse than persistence
    at 6 h, better at 1-3 days (persistence degrades faster) and worse again later.
    """
    good = [k for k in range(len(gap)) if _good(float(gap[k]))]
    if good and good[-1] == len(gap) - 1:
        return None
    if not good:  # lead 0 included: e.g. persistence, whose error at lead 0 is 0 like ours
        return float(lead_hours[0])
    j = good[-1]
    g0, g1 = float(gap[j]), float(gap[j + 1])
    if math.isnan(g1):
        return float(lead_hours[j + 1])
    return float(lead_hours[j] + (lead_hours[j + 1] - lead_hours[j]) * (-g0) / (g1 - g0))


def bad_leads_before(lead_hours: Sequence[float], gap: Sequence[float],
                     hours: float | None) -> list[float]:
    """Leads after 0 and before the crossing `hours` at which the forecast was already bad."""
    end = math.inf if hours is None else hours
    return [float(h) for h, g in zip(lead_hours, gap, strict=True)
            if 0 < h < end and not _good(float(g))]


def _gaps(skill: Skill, channel: str) -> dict[str, np.ndarray]:
    model = skill.series("rmse", "model", channel)
    return {"rmse_above_persistence_h": model - skill.series("rmse", "persistence", channel),
            "rmse_above_climatology_h": model - skill.series("rmse", "climatology", channel),
            "acc_below_0.6_h": USEFUL_ACC - skill.series("acc", "model", channel)}


def crossings(skill: Skill, channel: str) -> dict[str, float | None]:
    """From which lead on the model is worse than persistence and than climatology (RMSE),
    and its ACC below 0.6, in hours (None: not within the rollout)."""
    return {key: crossing_lead(skill.lead_hours, gap)
            for key, gap in _gaps(skill, channel).items()}


def describe_crossings(skill: Skill, channel: str) -> str:
    """One log line, e.g. 'z500: model RMSE above persistence from 40.1 h on, ...'."""
    horizon = skill.lead_hours[-1]
    parts = []
    labels = {"rmse_above_persistence_h": "RMSE above persistence",
              "rmse_above_climatology_h": "RMSE above climatology",
              "acc_below_0.6_h": f"ACC below {USEFUL_ACC}"}
    for key, gap in _gaps(skill, channel).items():
        hours = crossing_lead(skill.lead_hours, gap)
        earlier = ", ".join(f"{h:g}" for h in bad_leads_before(skill.lead_hours, gap, hours))
        if hours is None:
            when = f"only at {earlier} h" if earlier else f"at no lead up to {horizon} h"
        else:
            when = f"from {hours:.1f} h on" + (f" (and at {earlier} h)" if earlier else "")
        parts.append(f"{labels[key]} {when}")
    return f"{channel}: model " + "; ".join(parts)


# ------------------------------------------------------------------ reports
def table_leads(n_leads: int, steps_per_day: int = 4) -> list[int]:
    """Lead indices for a printed table: the first step, then every day, then the last."""
    picks = [1] + list(range(steps_per_day, n_leads, steps_per_day)) + [n_leads - 1]
    return sorted({k for k in picks if 1 <= k < n_leads})


def format_table(skill: Skill, channel_name: str, leads: Sequence[int] | None = None,
                 region: str = "global") -> list[str]:
    """A markdown table of one channel and region: RMSE and ACC of model and baselines by
    lead."""
    leads = table_leads(len(skill.lead_hours)) if leads is None else leads
    unit = units_of(channel_name)
    where = "" if region == "global" else f", {region}"
    lines = [f"| {channel_name}{where} lead | RMSE model | persistence | climatology "
             f"| time mean [{unit}] | ACC model | persistence |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for k in leads:
        r = [skill.series("rmse", f, channel_name, region)[k] for f in FORECASTS]
        a = [skill.series("acc", f, channel_name, region)[k] for f in FORECASTS[:2]]
        lines.append(f"| {skill.lead_hours[k]} h | {_num(r[0])} | {_num(r[1])} | {_num(r[2])} "
                     f"| {_num(r[3])} | {a[0]:.3f} | {a[1]:.3f} |")
    return lines


def _num(x: float) -> str:
    """4 significant digits (z500 errors are ~1e3 m2/s2, u10 errors ~1 m/s)."""
    return f"{x:.4g}" if abs(x) < 1e5 else f"{x:.3e}"


def wb2_name(name: str) -> tuple[str, str]:
    """(WeatherBench-2 variable name, level in hPa or '') of a channel."""
    c = channel_info(name)
    if c is None:
        return name, ""
    return c.variable, "" if c.level is None else str(c.level)


METRICS = ("rmse", "acc")
CSV_COLUMNS = ("region", "channel", "variable", "level", "units", "lead_step",
               "lead_hours") + tuple(f"{m}_{f}" for m in METRICS for f in FORECASTS)


def write_csv(skill: Skill, path: str) -> None:
    """One row per (region, channel, lead): RMSE and ACC of the model and every baseline;
    `variable` and `level` name the channel as WeatherBench-2 does."""
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(CSV_COLUMNS)
        for r, region in enumerate(skill.regions):
            for c, name in enumerate(skill.channels):
                for k, hours in enumerate(skill.lead_hours):
                    scores = [float(getattr(skill, m)[i, r, k, c]) for m in METRICS
                              for i in range(len(FORECASTS))]
                    out.writerow([region, name, *wb2_name(name), units_of(name), k, hours]
                                 + [f"{v:.9g}" for v in scores])


def _scores(skill: Skill, r: int, c: int) -> dict[str, dict[str, list[float]]]:
    return {m: {f: [float(v) for v in getattr(skill, m)[i, r, :, c]]
                for i, f in enumerate(FORECASTS)} for m in METRICS}


def skill_to_dict(skill: Skill, metadata: dict[str, Any]) -> dict[str, Any]:
    """Per channel: its names, the global scores and crossings at the top, and every
    region's scores under "regions"."""
    channels = {}
    for c, name in enumerate(skill.channels):
        variable, level = wb2_name(name)
        channels[name] = {
            "units": units_of(name), "variable": variable,
            "level": int(level) if level else None,
            **_scores(skill, skill.regions.index("global"), c),
            "crossings": crossings(skill, name),
            "regions": {region: _scores(skill, r, c) for r, region in enumerate(skill.regions)},
        }
    return {**metadata, "n_initial_conditions": skill.n_initial_conditions,
            "lead_hours": list(skill.lead_hours), "useful_acc": USEFUL_ACC,
            "regions": list(skill.regions), "climatology": skill.climatology,
            "channels": channels}


def dump_json(scores: dict[str, Any], path: str) -> None:
    """skill.json, from `skill_to_dict`'s dict (an ensemble's scores added beside)."""
    with open(path, "w") as f:
        json.dump(scores, f, indent=1)


def read_json(path: str) -> Skill:
    """A Skill back from `dump_json`'s file (to compare runs or re-plot)."""
    with open(path) as f:
        data = json.load(f)
    names, regions = list(data["channels"]), data["regions"]
    arrays = {m: np.array([[[data["channels"][n]["regions"][r][m][f] for n in names]
                            for r in regions] for f in FORECASTS]).transpose(0, 1, 3, 2)
              for m in METRICS}
    return Skill(lead_hours=data["lead_hours"], channels=names, rmse=arrays["rmse"],
                 acc=arrays["acc"], n_initial_conditions=data["n_initial_conditions"],
                 regions=regions, climatology=data["climatology"])
