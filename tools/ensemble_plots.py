"""Figures of an ensemble's skill (evaluation/ensemble_evaluation.py): CRPS against lead time
beside its references, spread/skill against lead time, rank histograms."""

from __future__ import annotations

import os
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from data.era5_names import units_of  # noqa: E402
from evaluation.ensemble_evaluation import EnsembleReport  # noqa: E402

STYLE = {"ensemble": dict(color="C0", ls="-", marker="o", ms=3),
         "perfect_model": dict(color="k", ls="-"),
         "deterministic": dict(color="C3", ls="-."),
         "persistence": dict(color="C1", ls="--"),
         "climatology": dict(color="C2", ls=":")}


def _columns(report: EnsembleReport, channels: Sequence[str], rows: int = 1):
    channels = [c for c in channels if c in report.channels]
    fig, axes = plt.subplots(rows, len(channels), figsize=(4.2 * len(channels), 3.4 * rows),
                             squeeze=False)
    return channels, fig, axes


def crps_vs_lead(report: EnsembleReport, channels: Sequence[str], title: str = "") -> plt.Figure:
    """The CRPS of the ensemble and of every reference (a single forecast's: its MAE)."""
    channels, fig, axes = _columns(report, channels)
    days = np.asarray(report.lead_hours) / 24.0
    for ax, name in zip(axes[0], channels, strict=True):
        for forecast in [*report.ensembles, *report.mae]:
            ax.plot(days, report.crps(forecast, name), label=forecast, **STYLE[forecast])
        ax.set_title(name)
        ax.set_xlabel("lead time [days]")
        ax.set_ylabel(f"CRPS [{units_of(name)}]")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def spread_skill(report: EnsembleReport, channels: Sequence[str], title: str = "") -> plt.Figure:
    """Spread/skill, plain (dashed) and corrected for the finite ensemble (solid), of the
    ensemble and the perfect-model ensemble; 1 is calibrated."""
    channels, fig, axes = _columns(report, channels)
    days = np.asarray(report.lead_hours) / 24.0
    for ax, name in zip(axes[0], channels, strict=True):
        for forecast in report.ensembles:
            color = STYLE[forecast]["color"]
            ax.plot(days[1:], report.score(forecast, "spread_skill_ratio_corrected", name)[1:],
                    color=color, label=f"{forecast}, corrected")
            ax.plot(days[1:], report.score(forecast, "spread_skill_ratio", name)[1:],
                    color=color, ls="--", label=f"{forecast}, plain")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(name)
        ax.set_xlabel("lead time [days]")
        ax.set_ylabel("spread / RMSE of the mean")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def rank_histograms(report: EnsembleReport, channels: Sequence[str], title: str = ""
                    ) -> plt.Figure:
    """Rank histograms at 1, 3 and 5 days (those within the rollout; else its last lead), one
    row per lead: flat (the dotted line) is calibrated, U-shaped under-dispersed."""
    leads = [k for k, h in enumerate(report.lead_hours) if h in (24, 72, 120)] \
        or [len(report.lead_hours) - 1]
    channels, fig, axes = _columns(report, channels, rows=len(leads))
    bins = np.arange(report.size + 1)
    for i, k in enumerate(leads):
        for ax, name in zip(axes[i], channels, strict=True):
            width = 0.8 / len(report.ranks)
            for j, forecast in enumerate(report.ranks):
                ax.bar(bins + j * width, report.histogram(forecast, name, k), width=width,
                       color=STYLE[forecast]["color"], label=forecast)
            ax.axhline(1.0 / (report.size + 1), color="grey", ls=":")
            ax.set_title(f"{name}, {report.lead_hours[k]} h")
            ax.set_xlabel("rank of the truth")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def save_figures(report: EnsembleReport, out_dir: str, title: str) -> list[str]:
    """crps_vs_lead.png, spread_skill.png and rank_histograms.png of the headline channels
    in `out_dir`; returns their names."""
    from data.era5_names import HEADLINE

    names = []
    for name, plot in (("crps_vs_lead", crps_vs_lead), ("spread_skill", spread_skill),
                       ("rank_histograms", rank_histograms)):
        fig = plot(report, HEADLINE, title)
        fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=90)
        plt.close(fig)
        names.append(f"{name}.png")
    return names
