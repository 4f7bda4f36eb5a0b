"""Checkpoints that lose nothing: atomic writes, the last K kept, layout-free tensors.

A checkpoint holds the full (unsharded) model and optimizer tensors keyed by parameter
name, so a run saved with one parallel layout resumes with another. It also holds the
schedule, loss scaler, iteration, data position (epoch, batches done in it) and every
rank's RNG states, so an interrupted run continues exactly where it stopped.

Files: <exp_dir>/checkpoints/ckpt_<iters:08d>.pt; `latest` is the newest complete file.
A save writes `<name>.tmp` and renames it: a crash mid-save leaves the previous files intact.
"""

from __future__ import annotations

import glob
import logging
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

FORMAT = "era5-vit-checkpoint"
VERSION = 1
# Config keys that must match for the saved tensors to fit the model.
MODEL_KEYS = ("img_size", "patch_size", "embed_dim", "depth", "num_heads",
              "n_in_channels", "n_out_channels")


class CheckpointError(ValueError):
    """An unreadable or incompatible checkpoint; the message names the file."""


def checkpoint_dir(exp_dir: str) -> str:
    return os.path.join(exp_dir, "checkpoints")


def list_checkpoints(exp_dir: str) -> list[str]:
    """Complete checkpoints, oldest first (temporary files are never listed)."""
    return sorted(glob.glob(os.path.join(checkpoint_dir(exp_dir), "ckpt_*.pt")))


def latest_checkpoint(exp_dir: str) -> str | None:
    files = list_checkpoints(exp_dir)
    return files[-1] if files else None


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, names: list[str],
                            to_full: Callable[[str, torch.Tensor], torch.Tensor]
                            ) -> dict[str, Any]:
    """Optimizer state keyed by parameter name, tensors in their full (serial) shape."""
    sd = optimizer.state_dict()
    ids = [i for group in sd["param_groups"] for i in group["params"]]
    state = {}
    for idx, name in zip(ids, names):
        st = sd["state"].get(idx, {})
        state[name] = {k: (to_full(name, v) if torch.is_tensor(v) and v.dim() > 0 else v)
                       for k, v in st.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any],
                         names: list[str],
                         to_local: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
    sd = optimizer.state_dict()
    ids = [i for group in sd["param_groups"] for i in group["params"]]
    state = {}
    for idx, name in zip(ids, names):
        st = saved["state"].get(name)
        if st:
            state[idx] = {k: (to_local(name, v) if torch.is_tensor(v) and v.dim() > 0 else v)
                          for k, v in st.items()}
    groups = []
    for group, saved_group in zip(sd["param_groups"], saved["param_groups"]):
        merged = dict(saved_group)
        merged["params"] = group["params"]
        # Keep the live lr object (a tensor when CUDA graphs capture the step).
        if torch.is_tensor(group.get("lr")):
            group_lr = group["lr"]
            group_lr.fill_(float(saved_group["lr"]))
            merged["lr"] = group_lr
        groups.append(merged)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def save_atomic(obj: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one


def prune(exp_dir: str, keep: int) -> None:
    for old in list_checkpoints(exp_dir)[:-keep] if keep > 0 else []:
        os.remove(old)


def read_checkpoint(path: str, params: Any) -> dict[str, Any]:
    """Load and check a checkpoint; any problem is a one-line CheckpointError."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} not found") from None
    except Exception as e:  # truncated or not a torch file
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else 'corrupt'})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a checkpoint of this project")
    if ckpt.get("version") != VERSION:
        raise CheckpointError(f"{path} has format version {ckpt.get('version')}, "
                              f"this code reads {VERSION}")
    for key in MODEL_KEYS:
        saved, now = ckpt["config"].get(key), params.get(key)
        if saved is not None and list(np.atleast_1d(saved)) != list(np.atleast_1d(now)):
            raise CheckpointError(f"{path} was saved with {key}={saved}, "
                                  f"the config has {key}={now}")
    return ckpt


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def _identity(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class Checkpointer:
    """Saves and restores everything a run needs to continue exactly.

    `to_full(name, local_tensor)` and `to_local(name, full_tensor)` convert between a
    rank's shard and the serial tensor (identity without model parallelism); they may be
    collective, so every rank calls `save` and `restore`; world rank 0 writes the file.
    """

    def __init__(self, exp_dir: str, params: Any, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
                 to_full: Callable = _identity, to_local: Callable = _identity):
        self.exp_dir, self.params = exp_dir, params
        self.model, self.optimizer, self.scheduler, self.scaler = (model, optimizer,
                                                                   scheduler, scaler)
        self.to_full, self.to_local = to_full, to_local
        self.keep = int(params.get("checkpoint_keep", 3) or 3)
        self.names = [n for n, _ in unwrap(model).named_parameters()]

    def save(self, iters: int, epoch: int, epoch_step: int) -> str | None:
        import torch.distributed as dist

        module = unwrap(self.model)
        model_sd = {n: self.to_full(n, p.detach()).cpu() for n, p in module.named_parameters()}
        opt = optimizer_state_by_name(self.optimizer, self.names, self.to_full)
        rngs = [rng_state()]
        rank = 0
        if dist.is_initialized():
            rngs = [None] * dist.get_world_size()
            dist.all_gather_object(rngs, rng_state())
            rank = dist.get_rank()
        path = None
        if rank == 0:
            path = os.path.join(checkpoint_dir(self.exp_dir), f"ckpt_{iters:08d}.pt")
            save_atomic({
                "format": FORMAT, "version": VERSION,
                "config": {k: self.params.get(k) for k in MODEL_KEYS},
                "params": self.params.to_dict(),
                "model": model_sd, "optimizer": opt,
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "iters": iters, "epoch": epoch, "epoch_step": epoch_step, "rng": rngs,
            }, path)
            prune(self.exp_dir, self.keep)
            log.info(f"Saved checkpoint {path} (iteration {iters})")
        if dist.is_initialized():
            dist.barrier()  # nobody exits or reads before the file is complete
        return path

    def restore(self, path: str) -> dict[str, Any]:
        """Load `path` into the live objects; returns {'iters', 'epoch', 'epoch_step'}."""
        import torch.distributed as dist

        ckpt = read_checkpoint(path, self.params)
        module = unwrap(self.model)
        missing = [n for n in self.names if n not in ckpt["model"]]
        if missing:
            raise CheckpointError(f"{path} has no tensor for parameter {missing[0]} "
                                  f"({len(missing)} missing)")
        with torch.no_grad():
            for name, p in module.named_parameters():
                local = self.to_local(name, ckpt["model"][name])
                if local.shape != p.shape:
                    raise CheckpointError(f"{path}: {name} has shape {tuple(local.shape)}, "
                                          f"the model expects {tuple(p.shape)}")
                p.copy_(local)
        load_optimizer_state(self.optimizer, ckpt["optimizer"], self.names, self.to_local)
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.scaler.load_state_dict(ckpt["scaler"])
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank < len(ckpt["rng"]):
            set_rng_state(ckpt["rng"][rank])
        log.info(f"Resumed from {path}: iteration {ckpt['iters']}, epoch {ckpt['epoch']}, "
                 f"{ckpt['epoch_step']} batches into it")
        return {k: ckpt[k] for k in ("iters", "epoch", "epoch_step")}
