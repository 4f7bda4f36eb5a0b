"""Forecast skill by lead time: latitude-weighted RMSE and ACC of a rollout and of the two
baselines every weather model is measured against.

    model        the autoregressive forecast x_k = model(x_{k-1}) from the initial state x_0
    persistence  "nothing changes": the forecast for every lead is x_0
    climatology  "the average weather": the forecast for every lead is `time_means`

Scores are accumulated as sums over initial conditions (`forecast_sums`), so that
data-parallel ranks can add their sums with one all-reduce before `skill_from_sums` divides:
    RMSE(lead, channel) = std_c * sqrt(mean over ICs of the weighted mean squared error)
    ACC(lead, channel)  = mean over ICs of the weighted anomaly correlation (evaluation/scores.py)
Fields are normalised; multiplying by the channel's global std gives physical units.
Climatology's anomaly is zero everywhere, so its ACC is 0 by definition (not 0/0).
A forecast counts as useful while its ACC stays >= 0.6.
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

from evaluation.scores import weighted_acc_channels, weighted_mse_channels
from utils.tile import Tile

FORECASTS = ("model", "persistence", "climatology")
USEFUL_ACC = 0.6
HEADLINE_CHANNELS = ("u10", "t2m", "z500")

# Physical units of the ERA5 channel families (first letters of the name).
_UNITS = (("tcwv", "kg/m2"), ("msl", "Pa"), ("sp", "Pa"), ("u", "m/s"), ("v", "m/s"),
          ("t", "K"), ("z", "m2/s2"), ("r", "%"))


def channel_units(name: str) -> str:
    return next((unit for prefix, unit in _UNITS if name.startswith(prefix)), "")


def forecast_sums(forecast: torch.Tensor, truth: torch.Tensor, climatology: torch.Tensor,
                  tile: Tile | None = None) -> torch.Tensor:
    """Sums over a batch of initial conditions, to be added up over batches and ranks.

    forecast, truth: (B, L+1, C, H, W) normalised fields at leads 0..L (forecast[:, 0] is
    the initial state); climatology: (1, C, H, W) normalised. With a `tile` (spatial
    parallelism) the fields and the climatology are this rank's tile of the grid, and the
    sums are those of the whole grid (collectives over "h-w").
    Returns float64 (3, 2, L+1, C): [model, persistence, climatology] x [sum of weighted
    MSE, sum of ACC].
    """
    B, L1 = truth.shape[:2]
    truth = truth.float()
    candidates = (forecast.float(), truth[:, :1].expand_as(truth),
                  climatology.float().expand_as(truth))
    sums = torch.zeros(len(FORECASTS), 2, L1, truth.shape[2], dtype=torch.float64,
                       device=truth.device)
    for i, pred in enumerate(candidates):
        sums[i, 0] = weighted_mse_channels(pred, truth, tile).double().sum(0)
        if FORECASTS[i] != "climatology":  # zero anomaly: ACC is 0 by definition
            acc = weighted_acc_channels(pred.reshape(B * L1, *pred.shape[2:]),
                                        truth.reshape(B * L1, *truth.shape[2:]), climatology,
                                        tile)
            sums[i, 1] = acc.view(B, L1, -1).double().sum(0)
    return sums


@dataclass
class Skill:
    """Scores of every forecast, lead and channel; arrays are (3 forecasts, L+1, C)."""

    lead_hours: list[int]
    channels: list[str]
    rmse: np.ndarray  # physical units
    acc: np.ndarray
    n_initial_conditions: int

    def index(self, channel: str) -> int:
        return self.channels.index(channel)

    def series(self, metric: str, forecast: str, channel: str) -> np.ndarray:
        """Scores by lead time of one forecast and channel, e.g. ('rmse', 'model', 'z500')."""
        return getattr(self, metric)[FORECASTS.index(forecast), :, self.index(channel)]


def skill_from_sums(sums: torch.Tensor, count: int, stds: Sequence[float],
                    lead_hours: Sequence[int], channels: Sequence[str]) -> Skill:
    """Divide the (all-reduced) sums of `forecast_sums` by the number of initial conditions."""
    s = sums.detach().cpu().double().numpy() / count
    stds = np.asarray(stds, dtype=np.float64).reshape(1, 1, -1)
    return Skill(lead_hours=list(lead_hours), channels=list(channels),
                 rmse=np.sqrt(s[:, 0]) * stds, acc=s[:, 1], n_initial_conditions=count)


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


def format_table(skill: Skill, channel: str, leads: Sequence[int] | None = None) -> list[str]:
    """A markdown table of one channel: RMSE and ACC of model and baselines by lead."""
    leads = table_leads(len(skill.lead_hours)) if leads is None else leads
    unit = channel_units(channel)
    lines = [f"| {channel} lead | RMSE model | persistence | climatology [{unit}] "
             "| ACC model | persistence |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for k in leads:
        r = [skill.series("rmse", f, channel)[k] for f in FORECASTS]
        a = [skill.series("acc", f, channel)[k] for f in FORECASTS[:2]]
        lines.append(f"| {skill.lead_hours[k]} h | {_num(r[0])} | {_num(r[1])} | {_num(r[2])} "
                     f"| {a[0]:.3f} | {a[1]:.3f} |")
    return lines


def _num(x: float) -> str:
    """4 significant digits (z500 errors are ~1e3 m2/s2, u10 errors ~1 m/s)."""
    return f"{x:.4g}" if abs(x) < 1e5 else f"{x:.3e}"


CSV_COLUMNS = ("channel", "units", "lead_step", "lead_hours") + tuple(
    f"{m}_{f}" for m in ("rmse", "acc") for f in FORECASTS)


def write_csv(skill: Skill, path: str) -> None:
    """One row per (channel, lead): RMSE and ACC of model, persistence and climatology."""
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(CSV_COLUMNS)
        for c, name in enumerate(skill.channels):
            for k, hours in enumerate(skill.lead_hours):
                scores = [float(getattr(skill, m)[i, k, c]) for m in ("rmse", "acc")
                          for i in range(len(FORECASTS))]
                out.writerow([name, channel_units(name), k, hours]
                             + [f"{v:.9g}" for v in scores])


def skill_to_dict(skill: Skill, metadata: dict[str, Any]) -> dict[str, Any]:
    channels = {}
    for c, name in enumerate(skill.channels):
        channels[name] = {
            "units": channel_units(name),
            **{m: {f: [float(v) for v in getattr(skill, m)[i, :, c]]
                   for i, f in enumerate(FORECASTS)} for m in ("rmse", "acc")},
            "crossings": crossings(skill, name),
        }
    return {**metadata, "n_initial_conditions": skill.n_initial_conditions,
            "lead_hours": list(skill.lead_hours), "useful_acc": USEFUL_ACC,
            "channels": channels}


def write_json(skill: Skill, path: str, metadata: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(skill_to_dict(skill, metadata), f, indent=1)


def read_json(path: str) -> Skill:
    """A Skill back from `write_json`'s file (to compare runs or re-plot)."""
    with open(path) as f:
        data = json.load(f)
    names = list(data["channels"])
    arrays = {m: np.stack([np.array([data["channels"][n][m][f] for n in names]).T
                           for f in FORECASTS]) for m in ("rmse", "acc")}
    return Skill(lead_hours=data["lead_hours"], channels=names, rmse=arrays["rmse"],
                 acc=arrays["acc"], n_initial_conditions=data["n_initial_conditions"])
