"""What a run reports: the tutorial's epoch lines on rank 0, and TensorBoard scalars with
the same names in every run so that runs can be compared side by side."""

from __future__ import annotations

import logging
import os
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from utils.run.figures import target_vs_prediction

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
        self.scalars(step, {"Loss/train": train_loss, "Learning Rate": lr,
                            "Avg iters per sec": iters / train_time,
                            "Avg samples per sec": samples / train_time})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
