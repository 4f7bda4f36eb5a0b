"""Target vs prediction maps for TensorBoard and the README."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def target_vs_prediction(pred: np.ndarray, target: np.ndarray, name: str = "t2m",
                         inp: np.ndarray | None = None) -> plt.Figure:
    """Side-by-side maps (H, W) of a channel, on one colour scale, plus the error."""
    panels = ([("input (t)", inp)] if inp is not None else []) + [
        ("target (t+6h)", target), ("prediction (t+6h)", pred), ("error", pred - target)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 2.6))
    lo, hi = float(np.min(target)), float(np.max(target))
    for ax, (title, field) in zip(axes, panels, strict=True):
        if title == "error":
            m = float(np.max(np.abs(field))) or 1.0
            im = ax.imshow(field, cmap="RdBu_r", vmin=-m, vmax=m)
        else:
            im = ax.imshow(field, cmap="inferno", vmin=lo, vmax=hi)
        ax.set_title(f"{name} {title}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(im, ax=ax, fraction=0.025)
    fig.tight_layout()
    return fig
