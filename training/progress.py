"""Where the training loop stands. A checkpoint holds all of it, so a resume continues
mid-epoch, with the same batches, and logs the same epoch averages."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Progress:
    iters: int = 0           # optimizer steps done
    epoch: int = 0           # the current epoch (1-based once training starts)
    epoch_step: int = 0      # batches of `epoch` done (0: its end-of-epoch work is done too)
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(()))  # this rank's
    step_count: int = 0      # steps summed in loss_sum

    def start_epoch(self) -> None:
        self.epoch += 1
        self.loss_sum = torch.zeros((), device=self.loss_sum.device)
        self.step_count = 0

    def record(self, loss: torch.Tensor) -> None:
        """One step done; the loss stays on the device (no host sync)."""
        self.loss_sum += loss
        self.iters, self.epoch_step, self.step_count = (self.iters + 1, self.epoch_step + 1,
                                                        self.step_count + 1)
