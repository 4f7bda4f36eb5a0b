"""What a run writes for people to read: log lines (rank 0 prints and writes out.log,
other ranks only warn), the tutorial's epoch lines, and TensorBoard scalars with the same names
in every run so that runs can be compared side by side, with target-vs-prediction maps."""

from __future__ import annotations

import logging
import math
import os
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.tensorboard import SummaryWriter

from training.disk import probe_space

if TYPE_CHECKING:
    import matplotlib.pyplot as plt


_FORMAT = "%(asctime)s - %(name)s - %(levelname)s - %(message)s"


def config_logger(rank: int = 0) -> logging.Logger:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(_FORMAT))
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    for noisy in ("matplotlib", "PIL", "h5py"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return root


class RunLogFile(logging.FileHandler):
    """out.log. A write that fails (the disk filled up during the run) is reported once on
    stderr and the file is closed: logging's default would print a "--- Logging error ---"
    block with a traceback for every line logged from then on."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        print(f"warning: cannot write {self.baseFilename} ({error}); log lines go to the "
              "console only from now on", file=sys.stderr, flush=True)
        logging.getLogger().removeHandler(self)
        try:
            self.close()
        except OSError:
            pass


def log_to_file(path: str) -> None:
    """Log to `path` as well, once a test write in its directory shows that there is room
    (OSError otherwise, e.g. ENOSPC on a full disk)."""
    probe_space(os.path.dirname(path) or ".")
    handler = RunLogFile(path, mode="a")
    handler.setFormatter(logging.Formatter(_FORMAT))
    logging.getLogger().addHandler(handler)




def target_vs_prediction(pred: np.ndarray, target: np.ndarray, name: str = "t2m",
                         inp: np.ndarray | None = None) -> plt.Figure:
    """Side-by-side maps (H, W) of a channel, on one colour scale, plus the error."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no screen
    import matplotlib.pyplot as plt

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


log = logging.getLogger(__name__)


class RunLog:
    def __init__(self, exp_dir: str, enabled: bool, purge_step: int | None = None):
        self.enabled = enabled
        # purge_step drops events at or after it when a run resumes: one continuous curve.
        self.writer = SummaryWriter(os.path.join(exp_dir, "logs"), purge_step=purge_step) \
            if enabled else None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def validation(self, step: int, val: dict[str, Any], t2m_stats: tuple[float, float]) -> None:
        self.scalars(step, {"Loss/valid": val["loss"], "RMSE(u10m)/valid": val["rmse_u10m"],
                            "RMSE(u10m)/persistence": val["persistence_rmse_u10m"],
                            "ACC(u10m)/valid": val["acc_u10m"], "ACC(t2m)/valid": val["acc_t2m"]})
        if "spread_u10m" in val:  # an ensemble: its spread beside its mean's RMSE
            self.scalars(step, {"Spread(u10m)/valid": val["spread_u10m"]})
        if self.writer is not None and val.get("example_t2m") is not None:
            mean, std = t2m_stats
            inp, tar, gen = (a * std + mean for a in val["example_t2m"])
            fig = target_vs_prediction(gen, tar, "t2m [K]", inp=inp)
            self.writer.add_figure("Visualization, t2m", fig, step, close=True)

    def epoch(self, epoch: int, step: int, train_time: float, samples: int, iters: int,
              train_loss: float, lr: float, val: dict[str, Any], val_time: float) -> None:
        log.info(f"Time taken for epoch {epoch} is {train_time:.2f} sec, "
                 f"avg {samples / train_time:.2f} samples/sec")
        log.info(f"  Avg train loss={train_loss:.6f}")
        log.info(f"  Avg val loss={val['loss']:.6f}")
        log.info(f"  Total validation time: {val_time:.2f} sec")
        log.info(f"  RMSE(u10m) model={val['rmse_u10m']:.4f} m/s, "
                 f"persistence={val['persistence_rmse_u10m']:.4f} m/s; "
                 f"ACC(u10m)={val['acc_u10m']:.4f}, ACC(t2m)={val['acc_t2m']:.4f}")
        if "spread_u10m" in val:
            log.info(f"  {spread_line(val)}")
        self.scalars(step, {"Loss/train": train_loss, "Learning Rate": lr,
                            "Avg iters per sec": iters / train_time,
                            "Avg samples per sec": samples / train_time})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def spread_line(val: dict[str, Any]) -> str:
    """An ensemble's validation line: its spread (u10m) against its mean's RMSE (model= in
    the line above), and their ratio, plain (WeatherBench-2's) and corrected for a finite
    ensemble (x sqrt((E + 1) / E), evaluation/ensemble_scores.py): 1 when the spread says
    how wrong the mean is."""
    ratio = val["spread_u10m"] / max(val["rmse_u10m"], 1e-12)
    corrected = ratio * math.sqrt((val["members"] + 1) / val["members"])
    return (f"Ensemble of {val['members']}: spread(u10m)={val['spread_u10m']:.4f} m/s; "
            f"spread/skill {ratio:.3f} plain, {corrected:.3f} corrected")
