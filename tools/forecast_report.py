"""inference.py's report (rank 0): the tables and lines in the log, the CSV and JSON files,
TensorBoard's scalars by lead time and the figures, of a forecast and of an ensemble."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
from torch.utils.tensorboard import SummaryWriter

from data.era5_names import HEADLINE, wb2_label
from evaluation.ensemble_evaluation import (
    EnsembleReport,
    add_to_skill_json,
    log_report,
    tensorboard_scalars,
    write_rank_csv,
)
from evaluation.ensemble_evaluation import write_csv as write_ensemble_csv
from evaluation.forecast_skill import (
    FORECASTS,
    Skill,
    describe_crossings,
    dump_json,
    format_table,
    skill_to_dict,
    write_csv,
)
from tools.ensemble_plots import save_figures
from tools.forecast_plots import rollout_maps, skill_vs_lead

log = logging.getLogger("inference")


def report(skill: Skill, out_dir: str, table_channels: list[str], maps: np.ndarray,
           map_channel: str, metadata: dict[str, Any],
           ensemble: EnsembleReport | None = None) -> None:
    """Tables and crossings in the log; skill.csv, skill.json, TensorBoard scalars by lead
    time (one event directory per forecast, so TensorBoard overlays them) and figures. An
    `ensemble`'s scores join skill.json and TensorBoard beside the deterministic ones
    (`model` is then its mean)."""
    table_channels = [c for c in dict.fromkeys(table_channels) if c in skill.channels]
    for name in table_channels:  # in order, without repeats
        log.info(f"Forecast skill of {name} ({wb2_label(name)}), mean over "
                 f"{skill.n_initial_conditions} initial conditions:\n"
                 + "\n".join(format_table(skill, name)))
    for name in table_channels:
        log.info(describe_crossings(skill, name))
    write_csv(skill, os.path.join(out_dir, "skill.csv"))
    scores = skill_to_dict(skill, metadata)
    dump_json(add_to_skill_json(scores, ensemble) if ensemble else scores,
              os.path.join(out_dir, "skill.json"))
    scalars = tensorboard_scalars(ensemble) if ensemble else {}
    for f, forecast in enumerate(FORECASTS):
        for r, region in enumerate(skill.regions):
            where = "forecast" if region == "global" else f"forecast/{region}"
            for c, name in enumerate(skill.channels):
                for k, hours in enumerate(skill.lead_hours):
                    scalars.setdefault(forecast, []).extend(
                        [(f"{where}/RMSE({name})", skill.rmse[f, r, k, c], hours),
                         (f"{where}/ACC({name})", skill.acc[f, r, k, c], hours)])
    for forecast, values in scalars.items():
        # purge_step 0: TensorBoard drops the events of an earlier evaluation in this directory
        with SummaryWriter(os.path.join(out_dir, "tensorboard", forecast), purge_step=0) as writer:
            for tag, value, hours in values:
                writer.add_scalar(tag, value, hours)
    fig = skill_vs_lead(skill, HEADLINE,
                        f"{metadata['config']}, iteration {metadata['iteration']}: "
                        f"{skill.n_initial_conditions} initial conditions")
    fig.savefig(os.path.join(out_dir, "skill_vs_lead.png"), dpi=110)
    # The maps at 1, 3 and 5 days (those within the rollout; else its last lead).
    leads = [k for k, h in enumerate(skill.lead_hours) if h in (24, 72, 120)] \
        or [len(skill.lead_hours) - 1]
    fig = rollout_maps(maps[0, leads], maps[1, leads], [skill.lead_hours[k] for k in leads],
                       map_channel)
    fig.savefig(os.path.join(out_dir, f"rollout_{map_channel}.png"), dpi=80)
    log.info(f"Wrote skill.csv, skill.json, skill_vs_lead.png, rollout_{map_channel}.png "
             f"and tensorboard/ to {out_dir}")


def report_ensemble(report: EnsembleReport, out_dir: str, table_channels: list[str],
                    metadata: dict[str, Any]) -> None:
    """The ensemble's tables and lines in the log; ensemble_skill.csv, rank_histograms.csv
    and figures (CRPS and spread/skill against lead time, rank histograms)."""
    log_report(report, [*HEADLINE, *table_channels], log)
    write_ensemble_csv(report, os.path.join(out_dir, "ensemble_skill.csv"))
    write_rank_csv(report, os.path.join(out_dir, "rank_histograms.csv"))
    names = save_figures(report, out_dir, f"{metadata['config']}, iteration "
                         f"{metadata['iteration']}: {report.size} members, "
                         f"{report.n_initial_conditions} initial conditions")
    log.info(f"Wrote ensemble_skill.csv, rank_histograms.csv, {', '.join(names)} to {out_dir}")
