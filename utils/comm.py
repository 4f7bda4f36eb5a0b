"""Named process groups for tensor (tp), context (cp) and data (dp) parallelism.

Call `init(tp, cp, order)` once per process after `torch.distributed` is initialised (the
train scripts do that; `init` initialises it from the launcher's environment otherwise).
It builds, on every process, the groups it belongs to:

    "tp"     ranks that hold different shards of the same layers (heads, MLP columns)
    "cp"     ranks that hold different slices of the token sequence
    "dp"     ranks that hold the same model and see different samples (DDP averages here)
    "tp-cp"  the whole model-parallel group: one full model replica

Everything also works without torch.distributed (one process): sizes 1, ranks 0, groups None.
Before `init` on a distributed job the layout is tp = cp = 1 and dp = the whole world
(group None, i.e. torch's default group).
"""

from __future__ import annotations

import torch.distributed as dist

from utils.launch_env import resolve_launch_env
from utils.rank_generator import RankGenerator

GROUP_NAMES = ("tp", "cp", "dp", "tp-cp")

_sizes: dict[str, int] = {}
_ranks: dict[str, int] = {}
_groups: dict[str, dist.ProcessGroup | None] = {}
_layout: RankGenerator | None = None


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def get_world_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_local_rank() -> int:
    """Rank within the node (selects the GPU), from the launcher's environment."""
    return resolve_launch_env().local_rank


def _check_name(name: str) -> None:
    if name not in GROUP_NAMES:
        raise KeyError(f"unknown process group {name!r}; expected one of {GROUP_NAMES}")


def get_size(name: str) -> int:
    _check_name(name)
    if name in _sizes:
        return _sizes[name]
    return get_world_size() if name == "dp" else 1


def get_rank(name: str) -> int:
    _check_name(name)
    if name in _ranks:
        return _ranks[name]
    return get_world_rank() if name == "dp" else 0


def get_group(name: str) -> dist.ProcessGroup | None:
    """The process group `name` this rank belongs to (None on one process)."""
    _check_name(name)
    return _groups.get(name)


def get_layout() -> RankGenerator | None:
    """The rank layout built by `init` (None before)."""
    return _layout


def init(tp: int = 1, cp: int = 1, order: str = "tp-cp-dp", backend: str | None = None,
         verbose: bool = False) -> None:
    """Build the tp, cp, dp and tp-cp groups for a tp x cp x dp layout.

    `order` lists the axes fastest-varying first (see utils.rank_generator). Every process
    must call this with the same arguments: creating a group is collective over the world.
    `backend` is only used when this call has to initialise torch.distributed itself.
    """
    global _layout
    if not is_distributed():
        env = resolve_launch_env()
        if env.distributed:
            dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                                    init_method=f"tcp://{env.master_addr}:{env.master_port}")
    world = get_world_size()
    if tp < 1 or cp < 1 or world % (tp * cp) != 0:
        raise ValueError(f"world size {world} is not divisible by tp*cp = {tp * cp} "
                         f"(tp={tp}, cp={cp}): choose tp and cp whose product divides it")
    layout = RankGenerator(tp, cp, world // (tp * cp), order)
    rank = get_world_rank()
    sizes, ranks, groups = {}, {}, {}
    for name in GROUP_NAMES:
        for members in layout.get_ranks(name):
            # new_group is collective over the whole world: every process creates every group
            group = dist.new_group(ranks=members) if is_distributed() else None
            if rank in members:
                sizes[name], ranks[name], groups[name] = len(members), members.index(rank), group
    reset()
    _sizes.update(sizes)
    _ranks.update(ranks)
    _groups.update(groups)
    _layout = layout
    if verbose and rank == 0:
        print(f"comm: world {world} = tp {tp} x cp {cp} x dp {layout.sizes['dp']} "
              f"(order {'-'.join(layout.order)}, fastest first)")


def reset() -> None:
    """Forget the layout (tests; the groups themselves live until torch.distributed ends)."""
    global _layout
    _sizes.clear()
    _ranks.clear()
    _groups.clear()
    _layout = None
