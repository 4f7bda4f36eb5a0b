"""An ensemble forecast scored lead by lead beside its references, as inference.py rolls it
out: the sums of one batch of initial conditions at one lead (`EnsembleSums.add`), added
over batches and data-parallel ranks, then the scores (`EnsembleSums.skill`).

    ensemble       the forecast's E members: CRPS (fair), its skill and spread terms,
                   ensemble-mean RMSE, spread, spread/skill plain and corrected
                   (evaluation/ensemble_scores.py), rank histograms
    perfect_model  the perfect-model ensemble of E members (a forced synthetic planet only:
                   evaluation/ensemble_members.py): the same scores
    deterministic  one forecast (the deterministic model's, when there is one), persistence
    persistence    and climatology, scored by their CRPS, which for one member is the
    climatology    mean absolute error (MAE)

Every score is per region, lead and channel (the data's and the derived ws10,
evaluation/references.py), latitude-weighted (evaluation/regions.py), in physical units.
Rank histograms leave out lead 0 and place ties by the seeded rule of
evaluation/ensemble_scores.py (seed 0, keyed by the initial time, the lead and the channel).
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from data.era5_names import units_of, wb2_label
from distributed import comm
from evaluation.ensemble_scores import (
    SCORES,
    EnsembleSkill,
    ensemble_skill_from_sums,
    ensemble_sums,
    rank_histogram_sums,
)
from evaluation.forecast_skill import table_leads, wb2_name
from evaluation.scores import weighted_mean_channels
from utils.tile import Tile

ENSEMBLES = ("ensemble", "perfect_model")
SINGLE = ("deterministic", "persistence", "climatology")
RANK_SEED = 0


class EnsembleSums:
    """Running sums of every score (module docstring) over initial conditions, to be added
    over data-parallel ranks (`sum_over`)."""

    def __init__(self, regions: int, leads: int, channels: int, size: int,
                 device: torch.device | str):
        z = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=device)  # noqa: E731
        self.ensembles = z(len(ENSEMBLES), 4, regions, leads, channels)
        self.mae = z(len(SINGLE), regions, leads, channels)
        self.ranks = z(len(ENSEMBLES), regions, max(leads - 1, 0), channels, size + 1)
        self.size = size
        self.has = {name: False for name in (*ENSEMBLES, *SINGLE)}

    def sum_over(self, group: str) -> EnsembleSums:
        """The sums of every rank of `group` (data-parallel ranks' initial conditions)."""
        for t in (self.ensembles, self.mae, self.ranks):
            comm.sum_over(t, group)
        return self

    @torch.no_grad()
    def add(self, lead: int, truth: torch.Tensor, forecasts: dict[str, torch.Tensor],
            weights: torch.Tensor, keys: Sequence[int], tile: Tile | None = None) -> None:
        """Add one lead of a batch: `truth` (B, C, H, W); `forecasts` by name, the ensembles'
        (B, E, C, H, W), the others' (B, C, H, W) (or broadcastable: a time-mean
        climatology); weights (R, H) of the whole grid; `keys` the initial times (the ties'
        draws); `tile` this rank's part of the grid."""
        for name, x in forecasts.items():
            self.has[name] = True
            if name in ENSEMBLES:
                i = ENSEMBLES.index(name)
                members = x.unsqueeze(2)  # one lead: (B, E, 1, C, H, W)
                self.ensembles[i, :, :, lead:lead + 1] += ensemble_sums(
                    members, truth.unsqueeze(1), weights, tile)
                if lead > 0:
                    self.ranks[i, :, lead - 1:lead] += rank_histogram_sums(
                        members, truth.unsqueeze(1), weights, keys, RANK_SEED, tile,
                        first_lead=lead)
            else:
                error = (x.float().expand_as(truth) - truth.float()).abs()
                mae = weighted_mean_channels(error, weights, tile)  # (B, R, C)
                self.mae[SINGLE.index(name), :, lead] += mae.double().sum(0)

    def skill(self, count: int, stds: Sequence[float], lead_hours: Sequence[int],
              channels: Sequence[str], regions: Sequence[str]) -> EnsembleReport:
        """The scores of `count` initial conditions (after the sums were all-reduced)."""
        scored = {name: ensemble_skill_from_sums(self.ensembles[i], count, stds, self.size,
                                                 lead_hours, channels, regions)
                  for i, name in enumerate(ENSEMBLES) if self.has[name]}
        std = np.asarray(stds, dtype=np.float64).reshape(1, 1, -1)
        mae = {name: self.mae[i].cpu().numpy() / count * std
               for i, name in enumerate(SINGLE) if self.has[name]}
        ranks = {name: self.ranks[i].cpu().numpy() / count
                 for i, name in enumerate(ENSEMBLES) if self.has[name]}
        return EnsembleReport(list(lead_hours), list(channels), list(regions), self.size,
                              count, scored, mae, ranks)


@dataclass
class EnsembleReport:
    """The scores: `ensembles` (name -> EnsembleSkill), `mae` (name -> (R, L+1, C)) and
    `ranks` (name -> (R, L, C, E + 1): each bin's weighted fraction, leads 1..L)."""

    lead_hours: list[int]
    channels: list[str]
    regions: list[str]
    size: int
    n_initial_conditions: int
    ensembles: dict[str, EnsembleSkill]
    mae: dict[str, np.ndarray]
    ranks: dict[str, np.ndarray]

    def crps(self, forecast: str, channel: str, region: str = "global") -> np.ndarray:
        """The CRPS by lead of any forecast (a single one's is its MAE)."""
        if forecast in self.ensembles:
            return self.ensembles[forecast].series("crps", channel, region)
        return self.mae[forecast][self.regions.index(region), :, self.channels.index(channel)]

    def score(self, forecast: str, score: str, channel: str, region: str = "global"
              ) -> np.ndarray:
        return self.ensembles[forecast].series(score, channel, region)

    def histogram(self, forecast: str, channel: str, lead: int, region: str = "global"
                  ) -> np.ndarray:
        """The rank histogram (E + 1 bins) of a lead (>= 1)."""
        return self.ranks[forecast][self.regions.index(region), lead - 1,
                                    self.channels.index(channel)]

    def flatness(self, forecast: str) -> np.ndarray:
        """(R, L+1, C): each rank histogram's normalised entropy, -sum_k p_k ln p_k /
        ln(E + 1): 1 for a flat histogram (a calibrated ensemble), 0 for one whose truth
        always takes the same rank; lower for a U (too little spread) or a dome (too
        much) alike. NaN at lead 0, which has no histogram."""
        p = self.ranks[forecast]
        terms = np.where(p > 0, -p * np.log(np.where(p > 0, p, 1.0)), 0.0)
        entropy = terms.sum(-1) / np.log(self.size + 1)
        lead0 = np.full(entropy.shape[:1] + (1,) + entropy.shape[2:], np.nan)
        return np.concatenate([lead0, entropy], axis=1)

    def by_score(self) -> dict[str, dict[str, np.ndarray]]:
        """Every score of every forecast, (R, L+1, C) each: {score: {forecast: array}}; a
        single forecast has a CRPS (its MAE) only."""
        out: dict[str, dict[str, np.ndarray]] = {s: {} for s in (*SCORES, FLATNESS)}
        for name, skill in self.ensembles.items():
            for score in SCORES:
                out[score][name] = skill.scores[score]
            out[FLATNESS][name] = self.flatness(name)
        for name, mae in self.mae.items():
            out["crps"][name] = mae
        return out


# The rank histograms' flatness (`EnsembleReport.flatness`), beside the scores of SCORES
# in skill.json and TensorBoard.
FLATNESS = "rank_histogram_flatness"
# TensorBoard's name of each score, as skill.json's "rmse" is RMSE there.
TENSORBOARD = {"crps": "CRPS", "crps_skill": "CRPSSkill", "crps_spread": "CRPSSpread",
               "ensemble_mean_rmse": "EnsembleMeanRMSE", "spread": "Spread",
               "spread_skill_ratio": "SpreadSkill",
               "spread_skill_ratio_corrected": "SpreadSkillCorrected",
               FLATNESS: "RankHistogramFlatness"}


def _values(x: np.ndarray) -> list[float | None]:
    """A score by lead for JSON: NaN (undefined, e.g. lead 0's ratios) as null."""
    return [None if np.isnan(v) else float(v) for v in x]


def add_to_skill_json(skill_json: dict, report: EnsembleReport) -> dict:
    """skill.json's dict (evaluation.forecast_skill.skill_to_dict) with the ensemble's
    scores beside the deterministic ones, named as in ensemble_skill.csv: under every
    channel (global) and each of its regions, {score: {forecast: [by lead]}}, the CRPS of
    every forecast (a single one's: its MAE), the other scores and the rank histograms'
    flatness of the ensembles; and the ensemble's size."""
    scores = report.by_score()
    for c, name in enumerate(report.channels):
        entry = skill_json["channels"][name]
        for r, region in enumerate(report.regions):
            values = {score: {f: _values(x[r, :, c]) for f, x in by.items()}
                      for score, by in scores.items()}
            if region == "global":
                entry.update(values)
            entry["regions"][region].update(values)
    skill_json["ensemble_size"] = report.size
    return skill_json


def tensorboard_scalars(report: EnsembleReport) -> dict[str, list[tuple[str, float, int]]]:
    """{forecast: [(tag, value, lead hours)]}: inference.py's TensorBoard scalars of the
    ensemble's scores, tagged as the deterministic ones ("forecast/CRPS(z500)",
    "forecast/<region>/..."), each forecast in its own event directory; undefined values
    (lead 0's ratios and histograms) left out."""
    out: dict[str, list[tuple[str, float, int]]] = {}
    for score, by in report.by_score().items():
        for forecast, x in by.items():
            for r, region in enumerate(report.regions):
                where = "forecast" if region == "global" else f"forecast/{region}"
                for c, name in enumerate(report.channels):
                    out.setdefault(forecast, []).extend(
                        (f"{where}/{TENSORBOARD[score]}({name})", float(v), hours)
                        for v, hours in zip(x[r, :, c], report.lead_hours, strict=True)
                        if not np.isnan(v))
    return out


def csv_columns(report: EnsembleReport) -> list[str]:
    return ([f"{s}_{name}" for name in report.ensembles for s in SCORES]
            + [f"crps_{name}" for name in report.mae])


def write_csv(report: EnsembleReport, path: str) -> None:
    """ensemble_skill.csv: one row per (region, channel, lead), skill.csv's first columns,
    then every score of each ensemble (`crps_ensemble`, ..., `spread_skill_ratio_corrected_
    perfect_model`) and the CRPS (= MAE) of each single forecast (`crps_deterministic`,
    `crps_persistence`, `crps_climatology`); a forecast not evaluated has no columns."""
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["region", "channel", "variable", "level", "units", "lead_step",
                      "lead_hours", "ensemble_size", *csv_columns(report)])
        for r, region in enumerate(report.regions):
            for c, name in enumerate(report.channels):
                for k, hours in enumerate(report.lead_hours):
                    values = [e.scores[s][r, k, c] for e in report.ensembles.values()
                              for s in SCORES] + [m[r, k, c] for m in report.mae.values()]
                    out.writerow([region, name, *wb2_name(name), units_of(name), k, hours,
                                  report.size] + [f"{float(v):.9g}" for v in values])


def write_rank_csv(report: EnsembleReport, path: str) -> None:
    """rank_histograms.csv: one row per (forecast, region, channel, lead >= 1), the weighted
    fraction of the grid in each of the E + 1 bins (`rank_0` .. `rank_E`)."""
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["forecast", "region", "channel", "lead_step", "lead_hours",
                      *(f"rank_{i}" for i in range(report.size + 1))])
        for name, ranks in report.ranks.items():
            for r, region in enumerate(report.regions):
                for c, channel in enumerate(report.channels):
                    for k in range(1, len(report.lead_hours)):
                        out.writerow([name, region, channel, k, report.lead_hours[k]]
                                     + [f"{v:.6g}" for v in ranks[r, k - 1, c]])


def format_table(report: EnsembleReport, channel: str, region: str = "global") -> list[str]:
    """A markdown table of one channel: the CRPS of every forecast, then the ensemble's
    mean RMSE, spread and spread/skill, by lead."""
    names = [*report.ensembles, *report.mae]
    lines = [f"| {channel} lead | " + " | ".join(f"CRPS {n}" for n in names)
             + f" | ens-mean RMSE | spread [{units_of(channel)}] | spread/skill plain "
             "| corrected |",
             "| ---: " * (len(names) + 5) + "|"]
    for k in table_leads(len(report.lead_hours)):
        crps = [report.crps(n, channel, region)[k] for n in names]
        e = [report.score("ensemble", s, channel, region)[k] for s in
             ("ensemble_mean_rmse", "spread", "spread_skill_ratio",
              "spread_skill_ratio_corrected")]
        lines.append(f"| {report.lead_hours[k]} h | " + " | ".join(f"{v:.4g}" for v in crps)
                     + f" | {e[0]:.4g} | {e[1]:.4g} | {e[2]:.3f} | {e[3]:.3f} |")
    return lines


def describe(report: EnsembleReport, channel: str) -> str:
    """One log line: at how many leads after 0 the ensemble's CRPS beats each single
    forecast's MAE, and its CRPS over the perfect-model ensemble's at the last lead."""
    ours = report.crps("ensemble", channel)[1:]
    parts = [f"CRPS below {name}'s MAE at {int((ours < report.crps(name, channel)[1:]).sum())}"
             f" of {len(ours)} leads" for name in report.mae]
    if "perfect_model" in report.ensembles:
        ratio = ours[-1] / report.crps("perfect_model", channel)[-1]
        parts.append(f"{ratio:.2f} x the perfect-model ensemble's at "
                     f"{report.lead_hours[-1]} h")
    return f"{channel}: ensemble " + "; ".join(parts)


def log_report(report: EnsembleReport, channels: Sequence[str], log: logging.Logger) -> None:
    """Each channel's table (`format_table`), then each one's line (`describe`), and how the
    rank histograms were made."""
    channels = [c for c in dict.fromkeys(channels) if c in report.channels]
    for name in channels:
        log.info(f"Ensemble skill of {name} ({wb2_label(name)}), {report.size} members, mean "
                 f"over {report.n_initial_conditions} initial conditions (a single "
                 "forecast's CRPS is its MAE):\n" + "\n".join(format_table(report, name)))
    for name in channels:
        log.info(describe(report, name))
    log.info("Rank histograms: lead 0 left out; a truth tied with members takes one of the "
             f"tied ranks by a draw seeded with {RANK_SEED}, the initial time, lead and "
             "channel (evaluation/ensemble_scores.py)")
