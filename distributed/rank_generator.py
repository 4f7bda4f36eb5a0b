"""Rank layout of a tp x cp x h x w x dp job: which global ranks form each process group.

Pure integer logic (no torch), so it can be tested and reasoned about without processes.

The axes are utils/parallel_axes.py's. The order string lists them from fastest- to
slowest-varying; axes it leaves out must have size 1. With the
default "tp-cp-h-w-dp" and tp=2, cp=2, dp=2, global rank r has coordinates
    tp = r % 2,   cp = (r // 2) % 2,   dp = r // 4
so the tensor-parallel partners (the most communication-hungry group) are adjacent ranks,
i.e. on the same node / NVLink domain.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from utils.parallel_axes import DEFAULT_ORDER, GROUPS, NAMES, parse_axes


class RankGenerator:
    """Maps global ranks to their coordinates on every axis (utils/parallel_axes.py) and
    enumerates process groups. `sizes`: axis name -> size; an axis not named has size 1."""

    def __init__(self, sizes: Mapping[str, int], order: str = DEFAULT_ORDER):
        unknown = sorted(set(sizes) - set(NAMES))
        if unknown:
            raise ValueError(f"unknown axis {', '.join(unknown)}: the axes are {NAMES}")
        sizes = {a: sizes.get(a, 1) for a in NAMES}
        for axis, size in sizes.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis} size must be a positive integer, got {size!r}")
        named = parse_axes(order)
        left_out = [a for a in NAMES if a not in named]
        if any(sizes[a] > 1 for a in left_out) or "dp" not in named:
            raise ValueError(f"order {order!r} must name dp and every axis of size > 1 "
                             f"({', '.join(a for a in NAMES if sizes[a] > 1 or a == 'dp')}) "
                             "exactly once")
        self.order = named + left_out  # axes of size 1 go anywhere: put them last
        self.sizes = sizes
        self.world_size = math.prod(sizes.values())
        # stride of each axis in the global rank: product of the sizes of faster axes
        self.strides: dict[str, int] = {}
        stride = 1
        for axis in self.order:
            self.strides[axis] = stride
            stride *= sizes[axis]

    def coords(self, rank: int) -> dict[str, int]:
        """Global rank -> {"tp": i, "cp": j, "h": k, "w": l, "dp": m}."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        return {a: (rank // self.strides[a]) % self.sizes[a] for a in NAMES}

    def rank(self, coords: dict[str, int]) -> int:
        """Inverse of `coords`."""
        return sum(coords.get(a, 0) * self.strides[a] for a in NAMES)

    def group_size(self, name: str) -> int:
        return math.prod(self.sizes[a] for a in _axes(name))

    def get_ranks(self, name: str) -> list[list[int]]:
        """All groups along the axes in `name` ("tp", "cp", "dp", "tp-cp", "h-w", "mp", or
        any axes joined by '-').

        A group is the set of ranks whose coordinates agree on every axis *not* in `name`.
        Each group is sorted by global rank (its position is the rank inside the group);
        groups are listed by their smallest member, identically on every process, which is
        what `torch.distributed.new_group` requires.
        """
        axes = _axes(name)
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            key = tuple(c[a] for a in NAMES if a not in axes)
            groups.setdefault(key, []).append(r)
        return sorted(groups.values())

    def partitions(self) -> list[tuple[tuple[str, ...], list[list[int]]]]:
        """The process groups a job of this layout makes, each set once: every distinct way
        the groups of `GROUPS` split the world, with the names that share it ("tp", "tp-cp"
        and "mp" are one partition while cp, h and w are 1), leaving out the groups of one
        rank (nothing crosses them; each group made costs a world-wide step on NCCL).

            RankGenerator({"tp": 2, "dp": 2}).partitions()
            == [(("tp", "tp-cp", "mp"), [[0, 1], [2, 3]]), (("dp",), [[0, 2], [1, 3]])]
        """
        found: dict[tuple[tuple[int, ...], ...], list[str]] = {}
        for name in GROUPS:
            if self.group_size(name) > 1:
                groups = tuple(tuple(g) for g in self.get_ranks(name))
                found.setdefault(groups, []).append(name)
        return [(tuple(names), [list(g) for g in groups]) for groups, names in found.items()]

    def group_of(self, name: str, rank: int) -> list[int]:
        """The members of `rank`'s group along `name`."""
        for ranks in self.get_ranks(name):
            if rank in ranks:
                return ranks
        raise AssertionError("unreachable: groups partition the world")


def _axes(name: str) -> tuple[str, ...]:
    """The axes of a group name: a registered group ("mp") or axes joined by '-'."""
    return GROUPS[name] if name in GROUPS else tuple(parse_axes(name))
