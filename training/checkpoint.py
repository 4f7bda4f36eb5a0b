"""Checkpoints that lose nothing: atomic writes, the last K kept, layout-free tensors.

A checkpoint holds the full (unsharded) model and optimizer tensors keyed by parameter
name, so a run saved with one parallel layout resumes with another. It also holds the
schedule, loss scaler, iteration, data position (epoch, batches done in it), and for every
rank its RNG states and its partial epoch loss, so an interrupted run continues exactly
where it stopped: same batches, same losses, bitwise the same parameters (same layout).

The files (ckpt_<iters:08d>.pt, atomic saves, keep-K, integrity, which one `--resume`
takes) are training/checkpoint_files.py. Parameters that are NaN/inf are never saved.

Checkpoints are loaded with `torch.load(weights_only=True)`: tensors and plain Python
containers only, so a checkpoint file cannot run code when it is loaded.

A fine-tune (`init_from`, `load_weights`) takes only the weights, unlike `--resume`, which
continues a run exactly: it starts at iteration 0 with a fresh optimizer and schedule, as
FourCastNet's second training stage does. The checkpoint's tensors are full (serial)
tensors; the run's layout cuts this rank's shard or
tile, so a checkpoint of any layout starts a fine-tune in any layout.

Ensembles (`ensemble_size` > 1) hold the same tensors on every ens rank, so they resume with
any ensemble_parallel_size. A deterministic model and an ensemble differ by the noise
layers (networks/noise.py): a deterministic checkpoint starts an ensemble only as a
fine-tune (`init_from`: the noise layers start at zero, so every member starts as the
deterministic model; said in the log), and `--resume` refuses it in one line
(`check_ensemble`), as it refuses an ensemble's checkpoint for a deterministic model."""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from distributed import comm, fsdp
from distributed.layout import Layout
from networks.noise import is_noise_parameter
from training.checkpoint_files import (  # noqa: F401 - also this module's API
    checkpoint_dir,
    checkpoint_iteration,
    damage,
    latest_checkpoint,
    list_checkpoints,
    newest_intact_checkpoint,
    prune,
    resolve_resume,
    save_atomic,
    set_aside_newer,
)
from training.disk import free_bytes, human_bytes
from training.progress import Progress
from utils.config_schema import Config
from utils.errors import CheckpointError, DivergedError
from utils.model_wrappers import unwrap

log = logging.getLogger(__name__)

FORMAT = "era5-vit-checkpoint"
VERSION = 1
# Config keys that must match for the saved tensors to fit the model.
MODEL_KEYS = ("model", "img_size", "patch_size", "embed_dim", "depth", "num_heads",
              "num_blocks", "mlp_ratio", "n_in_channels", "n_out_channels", "afno_variant")
REQUIRED = ("config", "model", "optimizer", "scheduler", "scaler", "iters", "epoch",
            "epoch_step", "rng")
# Config keys that must also match between two ensembles (the noise layers' shapes).
ENSEMBLE_KEYS = ("noise_channels", "noise_embed_dim")


# ------------------------------------------------------------------ RNG states
def rng_state() -> dict[str, Any]:
    """This process's RNG states, as tensors and plain values (weights_only-loadable)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ------------------------------------------------------------------ optimizer state by name
def optimizer_state_by_name(optimizer: torch.optim.Optimizer, names: list[str],
                            to_full: Callable[[str, torch.Tensor], torch.Tensor]
                            ) -> dict[str, Any]:
    """Optimizer state keyed by parameter name, tensors in their full (serial) shape."""
    sd = optimizer.state_dict()
    ids = [i for group in sd["param_groups"] for i in group["params"]]
    state = {}
    for idx, name in zip(ids, names, strict=True):
        st = sd["state"].get(idx, {})
        state[name] = {k: (to_full(name, v).cpu() if torch.is_tensor(v) and v.dim() > 0
                           else v) for k, v in st.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any],
                         names: list[str],
                         to_local: Callable[..., torch.Tensor],
                         path: str = "checkpoint") -> None:
    sd = optimizer.state_dict()
    if len(saved["param_groups"]) != len(sd["param_groups"]):
        raise CheckpointError(f"{path}: optimizer has {len(saved['param_groups'])} parameter "
                              f"groups, this model's has {len(sd['param_groups'])}")
    ids = [i for group in sd["param_groups"] for i in group["params"]]
    local_shapes = {n: p.shape for n, p in zip(names, _optimizer_params(optimizer),
                                               strict=True)}
    state = {}
    for idx, name in zip(ids, names, strict=True):
        st = saved["state"].get(name)
        if not st:
            continue
        state[idx] = {}
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0:
                v = to_local(name, v, path, f"optimizer state {k} of ")
                if v.shape != local_shapes[name]:
                    raise CheckpointError(f"{path}: optimizer state {k} of {name} has shape "
                                          f"{tuple(v.shape)}, the model expects "
                                          f"{tuple(local_shapes[name])}")
            state[idx][k] = v
    groups = [{**saved_group, "params": group["params"]}
              for group, saved_group in zip(sd["param_groups"], saved["param_groups"],
                                            strict=True)]
    live_lrs = [group["lr"] for group in optimizer.param_groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    # load_state_dict copies the groups. A tensor lr (CUDA graphs: the captured step reads
    # that very tensor, the scheduler fills it) must stay the same object: refill it.
    for group, live in zip(optimizer.param_groups, live_lrs, strict=True):
        if torch.is_tensor(live):
            live.fill_(float(group["lr"]))
            group["lr"] = live


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _cut(layout: Layout, name: str, full: torch.Tensor, param: torch.Tensor, where: str,
         what: str = "") -> torch.Tensor:
    """This rank's part of a checkpoint's full tensor, its errors (a tensor that does not
    split, or has another shape) as one-line CheckpointErrors."""
    try:
        local = layout.local_tensor(full, param)
    except (ValueError, RuntimeError, IndexError) as e:
        raise CheckpointError(f"{where}: {what}{name} of shape {tuple(full.shape)} does not "
                              f"fit this model ({str(e).splitlines()[0]})") from None
    if local.shape != param.shape:
        raise CheckpointError(f"{where}: {what}{name} has shape {tuple(local.shape)}, the "
                              f"model expects {tuple(param.shape)}")
    return local


@torch.no_grad()
def load_model_weights(params: dict[str, torch.Tensor], saved: dict[str, torch.Tensor],
                       layout: Layout, where: str, keep_noise_layers: bool = False) -> None:
    """Copy a checkpoint's full (serial) model tensors into the model's `params` (by name,
    as the unwrapped module's named_parameters gives them), each cut to this
    rank's part by the layout: resume, fine-tuning and evaluation all load weights here.
    Collective when the layout shards parameters. A missing or extra tensor, or one that
    does not fit, is a one-line CheckpointError. `keep_noise_layers`: a deterministic
    checkpoint into an ensemble; its noise layers keep their initial values."""
    if keep_noise_layers:
        params = {n: p for n, p in params.items() if not is_noise_parameter(n)}
    missing = [n for n in params if n not in saved]
    unexpected = [n for n in saved if n not in params]
    if missing or unexpected:
        which = (f"no tensor for parameter {missing[0]} ({len(missing)} missing)" if missing
                 else f"tensor {unexpected[0]}, which this model does not have "
                      f"({len(unexpected)} unexpected)")
        raise CheckpointError(f"{where} does not fit the model: {which}")
    for name, p in params.items():
        p.copy_(_cut(layout, name, saved[name], p, where).to(p.dtype))


# ------------------------------------------------------------------ reading
def read_checkpoint(path: str, cfg: Config | None) -> dict[str, Any]:
    """Load and check a checkpoint; any problem is a one-line CheckpointError.
    `cfg` None: no config to check against (the caller takes the checkpoint's own)."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} not found")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} is not a file")
    problem = damage(path)
    if problem:
        raise CheckpointError(f"checkpoint {path} is unreadable: {problem}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged archive, or objects other than tensors/plain values
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or ["corrupt"]
        # weights_only errors explain torch's defaults first; the cause is further down.
        cause = next((line for line in lines if "Unsupported" in line), lines[0])
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: "
                              f"{cause})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a checkpoint of this project")
    if ckpt.get("version") != VERSION:
        raise CheckpointError(f"{path} has format version {ckpt.get('version')}, "
                              f"this code reads {VERSION}")
    missing = [k for k in REQUIRED if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is incomplete: no {', '.join(missing)}")
    if cfg is not None:
        check_model_keys(ckpt, cfg, path)
    return ckpt


def check_model_keys(ckpt: dict[str, Any], cfg: Config, path: str) -> None:
    """The model's shape in `cfg` is the checkpoint's (its `config`), else a one-line
    CheckpointError."""
    for key in MODEL_KEYS:
        saved, now = ckpt["config"].get(key), getattr(cfg, key)
        if saved is not None and list(np.atleast_1d(saved)) != list(np.atleast_1d(now)):
            raise CheckpointError(f"{path} was saved with {key}={saved}, "
                                  f"the config has {key}={now}")


def saved_ensemble_size(ckpt: dict[str, Any]) -> int:
    """The ensemble size a checkpoint's model was trained with (1: deterministic, also for
    checkpoints older than ensembles)."""
    params = ckpt.get("params")
    return int(params.get("ensemble_size", 1)) if isinstance(params, dict) else 1


def check_ensemble(ckpt: dict[str, Any], cfg: Config, path: str, fine_tune: bool) -> bool:
    """Whether `cfg`'s model fits the checkpoint's, ensemble-wise (module docstring): two
    ensembles' noise layers must match (their ensemble sizes may differ); an ensemble's
    checkpoint never loads into a deterministic model; a deterministic checkpoint loads into
    an ensemble only as a fine-tune. Returns True for that fine-tune (the noise layers are
    new); any other mismatch is a one-line CheckpointError."""
    saved = saved_ensemble_size(ckpt)
    if saved > 1 and cfg.ensemble_size > 1:
        for key in ENSEMBLE_KEYS:
            was = ckpt["params"].get(key)
            if was is not None and was != getattr(cfg, key):
                raise CheckpointError(f"{path} was saved with {key}={was}, the config has "
                                      f"{key}={getattr(cfg, key)}")
        return False
    if saved > 1:
        raise CheckpointError(f"{path} holds an ensemble model (ensemble_size {saved}: its "
                              "members are conditioned on noise) and the config a "
                              f"deterministic one: give --ensemble_size {saved} (loss crps)")
    if cfg.ensemble_size == 1:
        return False
    if not fine_tune:
        raise CheckpointError(
            f"{path} holds a deterministic model and --resume continues a run as it was "
            f"saved, not as an ensemble of {cfg.ensemble_size}: start the ensemble from its "
            f"weights with --init_from {path} instead (a fine-tune: its noise layers start "
            "at zero, so every member starts as that model)")
    return True


class Checkpointer:
    """Saves and restores everything a run needs to continue exactly.

    The layout converts between a rank's shards and the serial tensors (by parameter name);
    that may be collective, so every rank calls `save` and `restore`; world rank 0 writes
    the file.
    """

    def __init__(self, exp_dir: str, cfg: Config, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
                 layout: Layout):
        self.exp_dir, self.cfg, self.layout = exp_dir, cfg, layout
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.keep = cfg.checkpoint_keep
        # this rank's parameters by name, of the module inside DDP and torch.compile
        self.params = dict(unwrap(model).named_parameters())
        self.names = list(self.params)
        self.last_saved: str | None = None  # what a failure message points the user to

    def to_full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        return self.layout.full_tensor(local, self.params[name])

    def to_local(self, name: str, full: torch.Tensor, where: str = "checkpoint",
                 what: str = "") -> torch.Tensor:
        return _cut(self.layout, name, full, self.params[name], where, what)

    def start_at(self, iters: int) -> None:
        """Called once the run knows where it starts (0, or the resumed iteration): checkpoints
        of this directory beyond that point are set aside (see `set_aside_newer`)."""
        if comm.get_world_rank() == 0:
            set_aside_newer(self.exp_dir, iters)

    def check_room(self) -> None:
        """Stop now, not at the first checkpoint hours later, if the disk cannot hold
        `checkpoint_keep` checkpoints plus the one being written (collective; rank 0
        looks). The size is this rank's parameters and Adam's two moments in fp32: a lower
        bound when the model is sharded."""
        error = None
        if comm.get_world_rank() == 0:
            directory = checkpoint_dir(self.exp_dir)
            each = 3 * sum(p.numel() * p.element_size() for p in self.params.values())
            files = max(self.keep + 1 - len(list_checkpoints(self.exp_dir)), 1)
            free = free_bytes(directory)
            if free < files * each:
                error = (f"not enough room for checkpoints in {directory}: "
                         f"{human_bytes(free)} free, {files} more checkpoint(s) of about "
                         f"{human_bytes(each)} need {human_bytes(files * each)} "
                         f"(checkpoint_keep {self.keep}, plus one being written): free "
                         "space there, set LOG_DIR to another disk, or lower checkpoint_keep")
        error = comm.broadcast_from_rank0(error)
        if error:
            raise CheckpointError(error, every_rank=True)

    def _device(self) -> torch.device:
        return next(iter(self.params.values())).device

    def save(self, progress: Progress) -> str | None:
        """Write ckpt_<iters>.pt (collective): the model, optimizer, schedule, scaler and
        where the loop stands (`progress`; its loss sum is this rank's, for the epoch
        average)."""
        iters, epoch, epoch_step = progress.iters, progress.epoch, progress.epoch_step
        loss_sum, step_count = progress.loss_sum, progress.step_count
        device = self._device()
        # Never replace a good checkpoint by a broken one: every rank checks its own shard.
        bad = next((n for n, p in self.params.items()
                    if not bool(torch.isfinite(fsdp.local(p.detach())).all())), None)
        if comm.any_rank(bad is not None, device):
            comm.settle()  # every rank raises now and exits
            raise DivergedError(
                f"parameters are NaN/inf at iteration {iters}"
                f"{f' ({bad})' if bad else ''}: not saved; the last checkpoint "
                f"{self.last_saved or '(none)'} is kept (lower the lr, or use bf16)")
        model_sd = {n: self.to_full(n, p.detach()).cpu() for n, p in self.params.items()}
        opt = optimizer_state_by_name(self.optimizer, self.names, self.to_full)
        loss = (loss_sum if loss_sum is not None else torch.zeros(())).detach().float().cpu()
        per_rank = [{"rng": rng_state(), "loss_sum": loss, "step_count": int(step_count)}]
        rank = 0
        if dist.is_initialized():
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, {"rng": rng_state(), "loss_sum": loss,
                                              "step_count": int(step_count)})
            rank = dist.get_rank()
        path = os.path.join(checkpoint_dir(self.exp_dir), f"ckpt_{iters:08d}.pt")
        error = None
        if rank == 0:
            try:
                save_atomic({
                    "format": FORMAT, "version": VERSION,
                    "config": {k: getattr(self.cfg, k) for k in MODEL_KEYS},
                    "params": self.cfg.model_dump(),
                    "model": model_sd, "optimizer": opt,
                    "scheduler": self.scheduler.state_dict(),
                    "scaler": self.scaler.state_dict(),
                    "iters": iters, "epoch": epoch, "epoch_step": epoch_step,
                    "rng": [r["rng"] for r in per_rank],
                    "loop": [{k: r[k] for k in ("loss_sum", "step_count")} for r in per_rank],
                }, path)
                prune(self.exp_dir, self.keep)
                log.info(f"Saved checkpoint {path} (iteration {iters})")
            except OSError as e:
                error = f"cannot write checkpoint {path}: {e.strerror or e}"
        # Nobody exits or reads before the file is complete, and a failed write stops
        # every rank (not only rank 0, leaving the others waiting).
        error = comm.broadcast_from_rank0(error)
        if error:
            comm.settle()  # every rank raises now and exits
            raise CheckpointError(error, every_rank=True)
        self.last_saved = path
        return path if rank == 0 else None

    def restore(self, path: str) -> Progress:
        """Load `path` into the live objects (collective). Returns where the loop stood,
        with this rank's epoch loss sum."""
        ckpt = read_checkpoint(path, self.cfg)
        check_ensemble(ckpt, self.cfg, path, fine_tune=False)
        load_model_weights(self.params, ckpt["model"], self.layout, path)
        load_optimizer_state(self.optimizer, ckpt["optimizer"], self.names, self.to_local,
                             path)
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.scaler.load_state_dict(ckpt["scaler"])
        rank = dist.get_rank() if dist.is_initialized() else 0
        # Same layout: this rank's own states (exact resume). Another world size: ranks
        # beyond the saved ones keep their seeded RNG and borrow a saved rank's epoch loss
        # (only the logged epoch average uses it).
        if rank < len(ckpt["rng"]):
            set_rng_state(ckpt["rng"][rank])
        loops = ckpt.get("loop") or [{"loss_sum": torch.zeros(()), "step_count": 0}]
        loop = loops[rank % len(loops)]
        self.last_saved = path
        log.info(f"Resumed from {path}: iteration {ckpt['iters']}, epoch {ckpt['epoch']}, "
                 f"{ckpt['epoch_step']} batches into it")
        return Progress(iters=int(ckpt["iters"]), epoch=int(ckpt["epoch"]),
                        epoch_step=int(ckpt["epoch_step"]),
                        loss_sum=loop["loss_sum"].to(self._device()),
                        step_count=int(loop["step_count"]))


def load_weights(path: str, cfg: Config, model: torch.nn.Module, layout: Layout) -> int:
    """Copy the model weights of checkpoint `path` into `model` (collective when the layout
    shards parameters); returns the iteration the checkpoint was saved at. Any mismatch
    (not a checkpoint, other model keys, missing or misshapen tensors) is a one-line
    CheckpointError."""
    ckpt = read_checkpoint(path, cfg)  # also checks the model keys against the config
    new_noise = check_ensemble(ckpt, cfg, path, fine_tune=True)
    load_model_weights(dict(unwrap(model).named_parameters()), ckpt["model"], layout,
                       f"init_from {path}", keep_noise_layers=new_noise)
    log.info(f"Fine-tuning: weights from {path} (iteration {ckpt['iters']}); "
             "starting at iteration 0 with a fresh optimizer and schedule")
    if new_noise:
        log.info(f"Fine-tuning a deterministic model into an ensemble of {cfg.ensemble_size}: "
                 "its noise layers are new and start at zero, so every member starts as "
                 "the deterministic model (networks/noise.py)")
    return int(ckpt["iters"])
