"""The layouts a config can run in on N GPUs, what each holds per rank, and which to choose.

    for layout in layouts(cfg, gpus=16): ...           # every split the schema accepts
    rows = plan_all(cfg, 16, gpu_memory_gb=40, gpus_per_node=4, device_type="cuda")

A layout: tp x cp for the ViT, h x w for the AFNO, ens (an ensemble's members split over
ranks; any divisor of ensemble_size), dp what is left and dividing the global batch; DDP, or
FSDP when dp > 1; activation checkpointing none or blocks. A rank computes local batch x
ensemble_size / ens members: memory grows with the ensemble, and ens is how a job trades
data-parallel ranks (samples) for members. Its row: one
rank's peak memory from the planner's trace (planning/memory.py) split into
parameters, gradients, optimizer state, activations and communication buffers, plus on a
GPU what no tensor shows, term by term (planning/memory_terms.py: the allocator's rounding,
workspaces and fragmentation, the CUDA context and kernels, NCCL's buffers for the
communicators of the layout, DALI's); `fits` when that peak is within what CUDA reports of
the GPU's memory. The fastest layout that fits, by this rule, in order (`fastest_key`):
  1. the model-parallel ranks of a replica within one node (--gpus_per_node): tp, cp and
     the mesh exchange activations inside every block, fast only over NVLink;
  2. no activation checkpointing: recomputing the blocks costs a forward pass more per
     step (docs/memory.md has the measured cost);
  3. fewer model-parallel ranks: each split adds collectives to every block and makes the
     matmuls smaller;
  4. fewer ens ranks: at a given number of GPUs and global batch each rank computes as many
     members either way, and the members split over ens add a gradient all-reduce (over
     ens, beside dp's) and a gather of the forecasts to every step;
  5. DDP before FSDP: FSDP gathers the parameters once more per step (1.5 times DDP's
     traffic) and its gathers wait in front of the blocks;
  6. the smaller peak.
The time model (planning/time_model.py, `python -m bench.dry_run --layouts all`) ranks the
layouts that fit by their predicted samples/s instead.
GB in the rows are GiB (2^30 bytes), as torch.cuda reports them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, get_args

import torch

from distributed import comm
from distributed.layout import Layout
from planning.fake_world import fake_world
from planning.memory import GIB, Estimate, trace_layout
from planning.memory_terms import MemoryTerms, Workload, beyond_tensors, communicators, usable_gib
from training.setup import batch_sizes
from utils.config_schema import Config
from utils.errors import ConfigError
from utils.parallel_axes import AXES, config_sizes, mp_ens_size


@dataclass(frozen=True)
class PlannedLayout:
    """One way to run the config: the axes' sizes, how dp holds the model, recompute."""

    dp: int
    tp: int = 1
    cp: int = 1
    h: int = 1
    w: int = 1
    ens: int = 1
    fsdp: bool = False
    activation_checkpointing: str = "none"

    @property
    def model_parallel(self) -> int:
        return self.tp * self.cp * self.h * self.w

    def flags(self) -> dict[str, Any]:
        """The config keys that run this layout."""
        return {"tp": self.tp, "cp": self.cp, "h_parallel_size": self.h,
                "w_parallel_size": self.w, "ensemble_parallel_size": self.ens,
                "fsdp": self.fsdp, "activation_checkpointing": self.activation_checkpointing}

    @classmethod
    def of(cls, cfg: Config, gpus: int) -> PlannedLayout:
        """The layout `cfg` runs in on `gpus` ranks."""
        per_dp_rank = mp_ens_size(config_sizes(cfg))
        return cls(gpus // per_dp_rank, cfg.tp, cfg.cp, cfg.h_parallel_size,
                   cfg.w_parallel_size, cfg.ensemble_parallel_size, cfg.fsdp,
                   cfg.activation_checkpointing)

    def label(self) -> str:
        split = " x ".join(f"{a} {n}" for a, n in (("tp", self.tp), ("cp", self.cp),
                                                   ("h", self.h), ("w", self.w),
                                                   ("ens", self.ens)) if n > 1)
        return (f"dp {self.dp}{' FSDP' if self.fsdp else ''}"
                f"{' x ' + split if split else ''}"
                f"{', recompute' if self.activation_checkpointing != 'none' else ''}")


def recompute_choices() -> tuple[str, ...]:
    """The values of the schema's `activation_checkpointing`."""
    annotation = Config.model_fields["activation_checkpointing"].annotation
    choices = get_args(annotation)
    return choices if choices and isinstance(choices[0], str) else get_args(choices[0])


def layouts(cfg: Config, gpus: int) -> list[PlannedLayout]:
    """Every layout `cfg` can run in on `gpus` ranks: splits the schema accepts (it checks
    the sizes against the model), dp dividing the global batch, FSDP when dp > 1."""
    axes = [a for a in AXES if a.key is not None]
    divisors = [n for n in range(1, gpus + 1) if gpus % n == 0]
    found = []
    for sizes in itertools.product(divisors, repeat=len(axes)):
        if gpus % math.prod(sizes):
            continue
        dp = gpus // math.prod(sizes)
        try:
            cfg.replace(**{a.key: n for a, n in zip(axes, sizes, strict=True)})
        except ConfigError:
            continue  # the schema refuses this split for this model
        if cfg.local_batch_size is None and cfg.global_batch_size % dp:
            continue
        named = dict(zip((a.name for a in axes), sizes, strict=True))
        for fsdp in (False, True) if dp > 1 else (False,):
            for ac in recompute_choices():
                found.append(PlannedLayout(dp, fsdp=fsdp, activation_checkpointing=ac, **named))
    return sorted(found, key=lambda lay: (lay.model_parallel, lay.tp, lay.cp, lay.h, lay.w,
                                          lay.ens, lay.fsdp, lay.activation_checkpointing))


def memory_row(cfg: Config, rank: Layout, local_batch: int, device_type: str,
               terms: MemoryTerms | None = None) -> dict[str, Any]:
    """This rank's estimate (its process groups exist) as a row of GB: every part, on a GPU
    every term beyond the tensors (`terms_gb`, planning/memory_terms.py) and what the
    allocator holds (`allocated_gb`, `reserved_gb`), the peak, after the first forward,
    the first step's peak."""
    estimate: Estimate = trace_layout(cfg, rank, local_batch, device_type)
    tensors = estimate.peak / GIB
    row = {**{f"{part}_gb": nbytes / GIB for part, nbytes in estimate.parts.items()},
           "tensor_peak_gb": tensors, "after_forward_gb": estimate.after_forward / GIB,
           "first_step_gb": estimate.first_step / GIB, "peak_phase": estimate.phase}
    if device_type != "cuda":
        return {**row, "terms_gb": {}, "allocated_gb": tensors, "reserved_gb": tensors,
                "peak_gb": tensors, "communicators": 0}
    sizes = {**config_sizes(cfg), "dp": comm.get_size("dp")}
    comms = communicators(sizes, cfg.parallel_order, comm.get_world_rank())
    channels = cfg.n_in_channels + cfg.n_out_channels * max(cfg.rollout_steps, 1)
    work = Workload.of(cfg.data_loader_config, local_batch, channels, rank.tile.shape, comms)
    terms_gb = beyond_tensors(estimate.peak, estimate.rounding, work, terms)
    allocated = tensors + terms_gb["allocator rounding"] + terms_gb["cuBLAS workspaces"]
    return {**row, "terms_gb": terms_gb, "allocated_gb": allocated,
            "reserved_gb": allocated + terms_gb["fragmentation"],
            "peak_gb": tensors + sum(terms_gb.values()), "communicators": len(comms)}


def plan(cfg: Config, layout: PlannedLayout, device_type: str, terms: MemoryTerms | None = None
         ) -> dict[str, Any]:
    """One layout's row, traced as rank 0 of the fake world this process is in."""
    run_cfg = cfg.replace(**layout.flags())
    comm.init(run_cfg.parallel_order, **config_sizes(run_cfg))
    rank = Layout.of_groups(run_cfg, None, torch.device("cpu"))
    local_batch, _ = batch_sizes(run_cfg, layout.dp)
    return {**asdict(layout), "amp_mode": cfg.amp_mode, "local_batch": local_batch,
            **memory_row(run_cfg, rank, local_batch, device_type, terms)}


def fastest_key(row: dict[str, Any], gpus_per_node: int) -> tuple:
    """The module docstring's rule, as a sort key (smallest first)."""
    model_parallel = row["tp"] * row["cp"] * row["h"] * row["w"]
    return (model_parallel > gpus_per_node, row["activation_checkpointing"] != "none",
            model_parallel, row["ens"], row["fsdp"], row["peak_gb"])


def plan_all(cfg: Config, gpus: int, gpu_memory_gb: float, gpus_per_node: int,
             device_type: str, terms: MemoryTerms | None = None,
             only: Callable[[PlannedLayout], bool] | None = None) -> list[dict[str, Any]]:
    """Every layout's row (`plan`; `only`: the layouts it accepts) on a fake world of `gpus`
    ranks, with `fits` (on a GPU: within what CUDA reports of `gpu_memory_gb` as sold) and,
    on the fastest that fits, `fastest`."""
    chosen = [lay for lay in layouts(cfg, gpus) if only is None or only(lay)]
    with fake_world(gpus):
        rows = [plan(cfg, layout, device_type, terms) for layout in chosen]
    usable = usable_gib(gpu_memory_gb, terms) if device_type == "cuda" else gpu_memory_gb
    for row in rows:
        row["usable_gb"] = usable
        row["fits"] = row["peak_gb"] <= usable
        row["fastest"] = False
    fitting = [r for r in rows if r["fits"]]
    if fitting:
        min(fitting, key=lambda r: fastest_key(r, gpus_per_node))["fastest"] = True
    return rows


def model_summary(cfg: Config) -> str:
    """The config's model in a few words, for a table's title line."""
    h, w = cfg.img_size
    return (f"{cfg.model}, {h}x{w}, patch {cfg.patch_size}, embed {cfg.embed_dim}, "
            f"depth {cfg.depth}")
