"""Figures of forecast skill: scores against lead time, and maps of one rollout.

    python -m tools.forecast_plots logs/cpu_base/1CPU/00/forecast/skill.json   # re-plot
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from data.era5_names import HEADLINE, units_of  # noqa: E402
from evaluation.forecast_skill import USEFUL_ACC, Skill, read_json  # noqa: E402

STYLE = {"model": dict(color="C0", ls="-", marker="o", ms=3),
         "persistence": dict(color="C1", ls="--"),
         "climatology": dict(color="C2", ls=":")}


def skill_vs_lead(skill: Skill, channels: Sequence[str] = HEADLINE,
                  title: str = "") -> plt.Figure:
    """RMSE (top row) and ACC (bottom row) against lead time, one column per channel."""
    channels = [c for c in channels if c in skill.channels]
    fig, axes = plt.subplots(2, len(channels), figsize=(4.2 * len(channels), 6.4),
                             squeeze=False, sharex=True)
    days = np.asarray(skill.lead_hours) / 24.0
    for col, name in enumerate(channels):
        top, bottom = axes[0, col], axes[1, col]
        for forecast, style in STYLE.items():
            top.plot(days, skill.series("rmse", forecast, name), label=forecast, **style)
            if forecast != "climatology":  # its ACC is 0 by definition
                bottom.plot(days, skill.series("acc", forecast, name), label=forecast, **style)
        top.set_title(f"{name}")
        top.set_ylabel(f"RMSE [{units_of(name)}]")
        top.set_ylim(bottom=0)
        bottom.axhline(USEFUL_ACC, color="grey", lw=0.8)
        bottom.set_ylabel("ACC")
        bottom.set_xlabel("lead time [days]")
        bottom.set_ylim(min(0.0, float(np.nanmin(skill.acc[:2]))), 1.02)
        top.grid(alpha=0.3)
        bottom.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(title or f"Forecast skill over {skill.n_initial_conditions} initial conditions")
    fig.tight_layout()
    return fig


def rollout_maps(truth: np.ndarray, forecast: np.ndarray, lead_hours: Sequence[int],
                 name: str) -> plt.Figure:
    """One row per lead: truth, forecast (one colour scale) and forecast - truth, (H, W)
    fields in physical units."""
    fig, axes = plt.subplots(len(lead_hours), 3, figsize=(12.6, 2.5 * len(lead_hours)),
                             squeeze=False)
    unit = units_of(name)
    for row, hours in enumerate(lead_hours):
        t, f = truth[row], forecast[row]
        lo, hi = float(np.min(t)), float(np.max(t))
        err = f - t
        m = float(np.max(np.abs(err))) or 1.0
        panels = (("truth", t, "inferno", lo, hi), ("forecast", f, "inferno", lo, hi),
                  ("error", err, "RdBu_r", -m, m))
        for ax, (label, field, cmap, vmin, vmax) in zip(axes[row], panels, strict=True):
            im = ax.imshow(field, cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
            ax.set_title(f"{name} {label}, +{hours / 24:g} d", fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
            fig.colorbar(im, ax=ax, fraction=0.025, label=unit)
    fig.tight_layout()
    return fig


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("skill_json", help="skill.json written by inference.py")
    p.add_argument("--channels", nargs="+", default=list(HEADLINE))
    p.add_argument("--out", default=None, help="PNG file (default: next to the JSON)")
    args = p.parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(args.skill_json), "skill_vs_lead.png")
    fig = skill_vs_lead(read_json(args.skill_json), args.channels)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
