"""The parallel axes of a job, declared once: the config schema, the rank layout, the process
groups and the model-parallel layers all ask here which axes exist.

A job's ranks form a grid, world = tp x cp x h x w x ens x dp. Each axis has a name (its
process group's), the config key that sets its size (dp has none: it is the world divided by
the others), and the family of parallelism it belongs to:

    tensor    the ViT split over ranks: its matmuls (tp) and its token sequence (cp)
    spatial   the AFNO's token grid split into tiles: rows (h) and columns (w)
    ensemble  an ensemble's members split over ranks (ens): each holds E / ens members of
              every sample, with the whole model, and reads the samples its ens peers read
    data      the batch split over replicas of the whole model (dp)

The tensor and spatial axes are model-parallel: their ranks hold different parts of one
model replica. Besides one group per axis, the ranks form a group per model-parallel family
("tp-cp", "h-w"), the group of every model-parallel axis, "mp" (one whole model replica),
and "mp-ens": the ranks that compute one loss together (a replica's shards and the ranks
holding the other members of the same samples; every axis but dp).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Axis:
    name: str
    key: str | None  # the config key of its size; None: what the world leaves (dp)
    family: str  # "tensor", "spatial" or "data"
    splits: str  # what its ranks divide between them

    @property
    def model_parallel(self) -> bool:
        return self.family in ("tensor", "spatial")


# Fastest-varying first in the default rank order: tp partners are adjacent ranks (one node).
AXES: tuple[Axis, ...] = (
    Axis("tp", "tp", "tensor", "the ViT's attention heads and MLP hidden units"),
    Axis("cp", "cp", "tensor", "the ViT's token sequence"),
    Axis("h", "h_parallel_size", "spatial", "the AFNO's token rows (latitude)"),
    Axis("w", "w_parallel_size", "spatial", "the AFNO's token columns (longitude)"),
    Axis("ens", "ensemble_parallel_size", "ensemble",
         "an ensemble's members (each rank holds E / ens of every sample's)"),
    Axis("dp", None, "data", "the batch (each rank holds a whole model replica)"),
)
BY_NAME: dict[str, Axis] = {a.name: a for a in AXES}
NAMES: tuple[str, ...] = tuple(BY_NAME)
MODEL_PARALLEL: tuple[str, ...] = tuple(a.name for a in AXES if a.model_parallel)
MODEL_PARALLEL_KEYS: tuple[str, ...] = tuple(a.key for a in AXES if a.model_parallel)
LAYOUT_KEYS: tuple[str, ...] = tuple(a.key for a in AXES if a.key is not None)  # every size
DEFAULT_ORDER = "-".join(NAMES)


def family_axes(family: str) -> tuple[str, ...]:
    """The axes of a family, in registry order: family_axes("spatial") == ("h", "w")."""
    return tuple(a.name for a in AXES if a.family == family)


# Every process group a job builds: one per axis, one per model-parallel family, "mp" and
# "mp-ens". A name lists its axes joined by '-' ("tp-cp"); "mp" is a name, not a list of axes.
GROUPS: dict[str, tuple[str, ...]] = {
    **{name: (name,) for name in NAMES},
    **{"-".join(family_axes(f)): family_axes(f) for f in ("tensor", "spatial")},
    "mp": MODEL_PARALLEL,
    "mp-ens": (*MODEL_PARALLEL, *family_axes("ensemble")),
}


def parse_axes(name: str) -> list[str]:
    """"tp-cp" -> ["tp", "cp"]; rejects unknown or repeated axes."""
    axes = name.split("-")
    unknown = [a for a in axes if a not in BY_NAME]
    if unknown or len(set(axes)) != len(axes):
        raise ValueError(f"bad axis list {name!r}: use names from {NAMES} joined by '-'")
    return axes


def config_sizes(cfg: Any) -> dict[str, int]:
    """The sizes a config sets, of every axis but dp: {"tp": cfg.tp, ..., "ens": ...}."""
    return {a.name: getattr(cfg, a.key) for a in AXES if a.key is not None}


def model_parallel_size(sizes: Mapping[str, int]) -> int:
    """Ranks that hold one model replica: the product of the model-parallel sizes."""
    return math.prod(sizes.get(a, 1) for a in MODEL_PARALLEL)


def mp_ens_size(sizes: Mapping[str, int]) -> int:
    """Ranks that read the same samples (the "mp-ens" group: every axis but dp); the world
    divided by it is dp."""
    return math.prod(sizes.get(a, 1) for a in GROUPS["mp-ens"])


def is_model_parallel(sizes: Mapping[str, int]) -> bool:
    """Whether one model replica is split over several ranks."""
    return model_parallel_size(sizes) > 1


def split_family(sizes: Mapping[str, int]) -> str | None:
    """The family whose axes split the model ("tensor" or "spatial"), None if none does.
    The schema lets only one family split a model (each model has its own)."""
    split = {BY_NAME[a].family for a in MODEL_PARALLEL if sizes.get(a, 1) > 1}
    if len(split) > 1:
        raise ValueError(f"sizes {dict(sizes)} split the model in more than one way")
    return split.pop() if split else None
