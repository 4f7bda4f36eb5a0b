"""Fine-tuning start (`init_from`): a new run that begins from a trained model's weights.

Unlike `--resume`, which continues a run exactly (optimizer moments, schedule, data position,
RNG), a fine-tune takes only the weights and starts at iteration 0 with a fresh optimizer and
schedule, as FourCastNet's second training stage does. The checkpoint's tensors are full
(serial) tensors; the run's `to_local` hook (the checkpointer's) cuts this rank's shard or
tile, so a checkpoint of any layout starts a fine-tune in any layout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from utils.errors import CheckpointError
from utils.model_wrappers import unwrap
from utils.run.checkpoint import read_checkpoint

log = logging.getLogger(__name__)


def _identity(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def load_weights(path: str, params: Any, model: torch.nn.Module,
                 to_local: Callable[[str, torch.Tensor], torch.Tensor] = _identity) -> int:
    """Copy the model weights of checkpoint `path` into `model` (collective when `to_local`
    is); returns the iteration the checkpoint was saved at. Any mismatch (not a checkpoint,
    other model keys, missing or misshapen tensors) is a one-line CheckpointError."""
    ckpt = read_checkpoint(path, params)  # also checks the model keys against the config
    saved = ckpt["model"]
    with torch.no_grad():
        for name, p in unwrap(model).named_parameters():
            if name not in saved:
                raise CheckpointError(f"init_from {path}: no tensor for parameter {name}")
            try:
                local = to_local(name, saved[name])
            except (ValueError, RuntimeError, IndexError) as e:
                raise CheckpointError(f"init_from {path}: {name} of shape "
                                      f"{tuple(saved[name].shape)} does not fit this model "
                                      f"({str(e).splitlines()[0]})") from None
            if local.shape != p.shape:
                raise CheckpointError(f"init_from {path}: {name} has shape "
                                      f"{tuple(local.shape)}, the model expects "
                                      f"{tuple(p.shape)}")
            p.copy_(local.to(p.device, p.dtype))
    log.info(f"Fine-tuning: weights from {path} (iteration {ckpt['iters']}); "
             "starting at iteration 0 with a fresh optimizer and schedule")
    return int(ckpt["iters"])
