"""The parallel layout of a job, decided once: every script asks it, none decides again.

World = tp x cp x h x w x ens x dp. What a layout changes, and nothing else does:

  - the process groups (tp, cp, h, w, ens, dp, and their unions; distributed/comm.py) and
    this process's device;
  - the model's layers: serial; `DistributedLayers` (ViT, tp x cp > 1), whose layers hold
    only this rank's shard of each weight; or `SpatialLayers` (AFNO, h x w > 1), whose
    layers work on this rank's tile of the grid. Both initialise to the serial numbers;
  - the `tile` of the grid this rank reads, trains on and scores (the whole grid unless the
    AFNO's grid is split over h x w);
  - how the loss's sums over the grid are completed (`sum_over_grid`): over the mesh's
    tiles, or not at all on a whole grid (the loss itself is networks/loss.py's);
  - which members of an ensemble this rank computes (`members`: E / ens of every sample,
    and their noise, the same on any layout) and how the loss gathers the others
    (`gather_members`: over the ens ranks, which read the same samples);
  - what runs after backward: parameters replicated across model-parallel ranks (norms,
    biases, embeddings) get their partial gradients summed over those ranks
    (`sync_shared_gradients`), and with ensemble parallelism every gradient is summed over
    the ens ranks (each holds the part its members gave); DDP averages over dp only;
  - how the data-parallel ranks share the model (`fsdp`): DDP replicas, or FSDP2, which
    shards parameters, gradients and optimizer state over dp (distributed/fsdp.py);
  - fp16 loss scaling: the ranks that compute one loss together (a model replica's shards
    and its ens peers; every rank under FSDP) agree whether a step overflowed
    (`grad_scaler`);
  - how a checkpoint's full (serial) tensors map to this rank's shards and back, by
    parameter name, so any layout resumes, fine-tunes or evaluates any checkpoint.

    layout = Layout.data_parallel(cfg)    # train.py: one device or DDP
    layout = Layout.model_parallel(cfg)   # train_mp.py, inference.py, benchmarks
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distributed import comm, fsdp
from distributed.helpers import (
    gather_tensor,
    shard_tensor,
    sum_gradients_over,
    sync_shared_gradients,
)
from distributed.launch_env import LaunchEnv
from distributed.layers import DistributedLayers
from distributed.loss_scaling import AgreedGradScaler
from distributed.mappings import gather_from_parallel_region, reduce_from_parallel_region
from distributed.spatial import SpatialLayers, field_tile
from networks.ensemble import Members
from networks.loss import GatherMembers, SumOverGrid
from utils.config_schema import Config
from utils.errors import ConfigError
from utils.parallel_axes import (
    BY_NAME,
    MODEL_PARALLEL,
    NAMES,
    config_sizes,
    is_model_parallel,
    split_family,
)
from utils.precision import Precision
from utils.tile import Tile

log = logging.getLogger("layout")


@dataclass(frozen=True)
class Layout:
    """This process's place in the job and what it means for the model (module docstring).

    `kind`: 'serial' (one device or DDP: every rank holds the whole model), 'tensor' (the
    ViT split over tp x cp) or 'spatial' (the AFNO's grid split over h x w). `fsdp`: the
    data-parallel ranks shard the model (FSDP2) instead of each holding a replica (DDP)."""

    kind: str
    order: str  # the rank layout's axes, fastest-varying first (parallel_order)
    env: LaunchEnv
    device: torch.device
    layers: Any  # the networks' layer factory; None: their serial layers
    tile: Tile
    fsdp: bool = False

    # ------------------------------------------------------------------ building one
    @classmethod
    def data_parallel(cls, cfg: Config) -> Layout:
        """train.py's layout: every rank holds the whole model: data parallelism, and
        ensemble parallelism (ranks that split an ensemble's members)."""
        sizes = config_sizes(cfg)
        if is_model_parallel(sizes):
            split = ", ".join(f"{BY_NAME[a].key} {n}" for a, n in sizes.items()
                              if n > 1 and a in MODEL_PARALLEL)
            raise ConfigError(f"config '{cfg.config}' sets {split}: train.py trains "
                              "data-parallel only; run train_mp.py for model parallelism")
        return cls.model_parallel(cfg)

    @classmethod
    def model_parallel(cls, cfg: Config) -> Layout:
        """Join the job and build the tp x cp x h x w x ens x dp process groups of `cfg`
        (every process of the job calls this with the same config), then decide the rest."""
        env, device = comm.init_process(cfg.parallel_order, **config_sizes(cfg))
        return cls.of_groups(cfg, env, device)

    @classmethod
    def of_groups(cls, cfg: Config, env: LaunchEnv, device: torch.device) -> Layout:
        """The layout of process groups that exist already (comm.init ran)."""
        kind = split_family({a: comm.get_size(a) for a in MODEL_PARALLEL}) or "serial"
        shard = sharded_over_dp(cfg)
        if kind == "spatial":  # the schema allows a mesh only for the AFNO
            return cls("spatial", cfg.parallel_order, env, device, SpatialLayers(),
                       field_tile(cfg.img_size, cfg.patch_size), shard)
        whole = Tile.whole(cfg.img_size)
        if kind == "tensor":  # ... only for the ViT
            return cls("tensor", cfg.parallel_order, env, device, DistributedLayers(), whole,
                       shard)
        return cls("serial", cfg.parallel_order, env, device, None, whole, shard)

    # ------------------------------------------------------------------ training
    @property
    def sum_over_grid(self) -> SumOverGrid | None:
        """How a loss completes its sums over the grid (networks/loss.py): on a mesh, each
        rank's sums are of its tile, summed over "h-w" (the backward passes each tile its own
        gradient); None when this rank holds the whole grid."""
        if self.tile.is_whole:
            return None
        return functools.partial(reduce_from_parallel_region, group_name="h-w")

    @property
    def is_model_parallel(self) -> bool:
        """Whether the model is split over several ranks (tensor or spatial: the family of
        axes that split it, `utils.parallel_axes.split_family`)."""
        return self.kind != "serial"

    @property
    def is_ensemble_parallel(self) -> bool:
        """Whether an ensemble's members are split over several (ens) ranks."""
        return comm.get_size("ens") > 1

    @property
    def shares_loss(self) -> bool:
        """Whether other ranks than this one's data-parallel replicas compute its loss with
        it (the "mp-ens" group: a model's shards, an ensemble's members)."""
        return self.is_model_parallel or self.is_ensemble_parallel

    @property
    def gather_members(self) -> GatherMembers | None:
        """How the loss gathers an ensemble's members, (B, M, ...) -> (B, E, ...): over the
        ens ranks, in rank order (rank e holds members e M .. (e + 1) M - 1); None when
        this rank holds them all. Every ens rank then scores the same members, so the
        gather's backward keeps this rank's part of the gradient ("split")."""
        if not self.is_ensemble_parallel:
            return None
        return _gather_members

    def members(self, cfg: Config) -> Members | None:
        """The ensemble members this rank computes and draws noise for (networks/ensemble.py),
        None for a deterministic model: E / ens of every sample, on this rank's tokens."""
        if cfg.ensemble_size == 1:
            return None
        ens, p = comm.get_size("ens"), cfg.patch_size
        count = cfg.ensemble_size // ens
        t = self.tile
        return Members(size=cfg.ensemble_size, first=comm.get_rank("ens") * count,
                       count=count, noise_channels=cfg.noise_channels,
                       grid=(t.grid[0] // p, t.grid[1] // p),
                       rows=slice(t.rows.start // p, t.rows.stop // p),
                       cols=slice(t.cols.start // p, t.cols.stop // p), seed=cfg.seed,
                       dp_rank=comm.get_rank("dp"), dp_size=comm.get_size("dp"))

    @property
    def reduces_after_backward(self) -> bool:
        """Whether gradients need sums after backward (`after_backward`)."""
        return self.shares_loss

    def after_backward(self, model: nn.Module) -> None:
        """Between backward and the optimizer step (the step calls it where
        `reduces_after_backward`): complete the gradients of parameters replicated across
        model-parallel ranks, then sum every gradient over the ens ranks. Gradient
        clipping, or anything else that reads the gradients, comes after this."""
        sync_shared_gradients(model)
        sum_gradients_over(model, "ens")

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module) -> Iterator[None]:
        """Forward passes without backward (validation): under FSDP the parameters are
        gathered once for all of them (`fsdp.gathered`: the data-parallel ranks may run
        different numbers of batches)."""
        with fsdp.gathered(model) if self.fsdp else contextlib.nullcontext():
            yield

    def grad_scaler(self, precision: Precision) -> torch.amp.GradScaler:
        """The run's loss scaler (enabled for fp16 only; `training.run.build_training`).
        On a model-parallel layout the ranks of "mp" (tp x cp x h x w) hold different
        shards of the gradients; under FSDP every rank holds its own slice of them, over
        dp too. Their overflow verdict is agreed (MAX over the group,
        distributed/loss_scaling.py), so they all skip a step if one shard overflowed.
        The ens ranks join the verdict ("mp-ens"): their gradients are summed before it,
        so they agree already, but a verdict that depends on local values is agreed by
        every rank that shares the loss, whatever the order of the sums."""
        if precision.mode != "fp16" or not (self.shares_loss or self.fsdp):
            return precision.grad_scaler()
        return AgreedGradScaler(self.device.type, self.overflow_group)

    @property
    def overflow_group(self) -> dist.ProcessGroup | None:
        """The group whose ranks agree on an fp16 overflow (`grad_scaler`): "mp-ens", or
        under FSDP every rank (None)."""
        return None if self.fsdp else comm.get_group("mp-ens")

    # ------------------------------------------------------------------ checkpoints
    def full_tensor(self, local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """The serial-layout tensor of `param` (itself, its gradient or an optimizer state
        of its shape) from every rank's part: collective over the groups that shard it
        (dp under FSDP, then the model-parallel groups)."""
        whole = fsdp.gather(local)
        return gather_tensor(whole, param) if self.is_model_parallel else whole

    def local_tensor(self, full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """This rank's part of the serial-layout tensor `full`, laid out like `param`
        (under FSDP a DTensor, each rank keeping its slice: no communication)."""
        local = shard_tensor(full, param) if self.is_model_parallel else full
        return fsdp.shard_like(local.to(param.device), param)

    # ------------------------------------------------------------------ reporting
    def describe(self) -> str:
        mesh = (f", H = {comm.get_size('h')}, W = {comm.get_size('w')}"
                if self.kind == "spatial" else "")
        ens = f", ENS = {comm.get_size('ens')}" if self.is_ensemble_parallel else ""
        sharded = ", FSDP" if self.fsdp else ""
        return (f"Layout: DP = {comm.get_size('dp')}{sharded}, TP = {comm.get_size('tp')}, "
                f"CP = {comm.get_size('cp')}{mesh}{ens} (order {self.order})")

    def sizes(self) -> dict[str, int]:
        """Every group's size, for logs and result files."""
        return {a: comm.get_size(a) for a in NAMES}


def _gather_members(x: torch.Tensor) -> torch.Tensor:
    """(B, M, ...) of every ens rank -> (B, ens M, ...), differentiable (`gather_members`)."""
    return gather_from_parallel_region(x, 1, "ens", [x.shape[1]] * comm.get_size("ens"))


def sharded_over_dp(cfg: Config) -> bool:
    """Whether FSDP shards the model: asked for (`fsdp`) and more than one data-parallel
    rank to shard it over (with one, it is said once and the model stays whole)."""
    if cfg.fsdp and comm.get_size("dp") == 1:
        if comm.get_world_rank() == 0:
            log.warning("--fsdp with 1 data-parallel rank: nothing to shard over, so the "
                        "model stays whole (FSDP divides by the number of dp ranks)")
        return False
    return cfg.fsdp

