"""The job of N GPUs built, checked, stepped and planned in this one process.

    job = PlannedJob(cfg, gpus=1024, gpus_per_node=4)  # the config's layout on 1,024 GPUs
    job.check_nodes(); job.partition_problems()         # before anything runs
    report = job.role(rank)                             # one rank, built as the job builds it

Each rank role runs what the train scripts run, on PyTorch's fake backend
(planning/fake_world.py): `comm.init` makes its process groups, `Layout.of_groups` decides
the layout, the model, FSDP2 and the step are training's own (planning/step_trace.py), and
the memory planner traces its peak (planning/layouts.py). What each role adds:
  - its groups checked against the rank generator (`group_problems`): the size, the rank
    and the members of each group, as torch.distributed holds them;
  - every collective of one step (planning/collectives.py), each with its axis and whether
    its group crosses nodes;
  - the step's trace for the time model (planning/time_model.py).
The roles (`roles`): the first and the last rank, and a rank at every position of each
model-parallel axis (the others at 0) and at both ends of dp: where the splits are uneven
(the first chunks are the bigger), these are the ranks that differ.
The whole job is checked without building it: every rank in exactly one group of each axis,
the axes orthogonal (`partition_problems`), and no tensor-parallel group across nodes
(`check_nodes`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from distributed import comm
from distributed.layout import Layout
from distributed.rank_generator import RankGenerator
from planning.collectives import Collective
from planning.fake_world import fake_world
from planning.layouts import memory_row
from planning.step_trace import Trace, trace_step, uses_ddp
from planning.time_model import Placement
from training.setup import batch_sizes
from utils.config_schema import Config
from utils.errors import ConfigError, UserError
from utils.parallel_axes import GROUPS, NAMES, config_sizes, mp_ens_size


@dataclass
class Role:
    """One rank of the job, dry-run: its place, its groups' check, its step and memory."""

    rank: int
    coords: dict[str, int]
    problems: list[str]
    trace: Trace
    memory: dict[str, Any] = field(default_factory=dict)
    fsdp: bool = False
    ddp: bool = False
    wall_s: float = 0.0

    @property
    def groups_ok(self) -> bool:
        return not self.problems


class PlannedJob:
    """The config's layout on `gpus` GPUs, `gpus_per_node` to a node."""

    def __init__(self, cfg: Config, gpus: int, gpus_per_node: int, device_type: str = "cuda"):
        self.cfg, self.gpus, self.gpus_per_node = cfg, gpus, gpus_per_node
        self.device_type = device_type
        sizes = config_sizes(cfg)
        per_dp_rank = mp_ens_size(sizes)
        split = " x ".join(str(sizes[a]) for a in sizes)
        if gpus < 1 or gpus % per_dp_rank:
            raise UserError(f"--gpus {gpus} is not divisible by {' x '.join(sizes)} = {split}: "
                            "give a multiple of their product")
        if gpus_per_node < 1:
            raise UserError(f"--gpus_per_node {gpus_per_node}: expected a positive number")
        self.dp = gpus // per_dp_rank
        try:
            self.local_batch, self.global_batch = batch_sizes(cfg, self.dp)
        except ConfigError as e:
            raise UserError(f"{e}: give --local_batch_size (samples per GPU)") from None
        self.generator = RankGenerator({**sizes, "dp": self.dp}, cfg.parallel_order)
        self.axis_of = axis_names(self.generator)

    # ---------------------------------------------------------------- the whole job
    def check_nodes(self) -> None:
        """A tensor-parallel group must sit on one node (its collectives run in every
        layer); one that crosses nodes is a one-line error."""
        for group in self.generator.get_ranks("tp"):
            if Placement.of(tuple(group), self.gpus_per_node).crosses_nodes:
                raise UserError(
                    f"--gpus_per_node {self.gpus_per_node} splits the tp group {group} "
                    f"across nodes: use a tp that divides {self.gpus_per_node}, and keep tp "
                    f"first in --parallel_order ({self.cfg.parallel_order} now)")

    def partition_problems(self) -> list[str]:
        """Every rank in exactly one group of each axis, of the axis's size, and the axes
        orthogonal: two ranks that share a group of one axis share none of another."""
        gen, problems = self.generator, []
        group_of: dict[str, list[int]] = {}
        for name in GROUPS:
            index = [-1] * self.gpus
            for i, group in enumerate(gen.get_ranks(name)):
                if len(group) != gen.group_size(name):
                    problems.append(f"{name} group {group} has {len(group)} ranks, not "
                                    f"{gen.group_size(name)}")
                for r in group:
                    if index[r] != -1:
                        problems.append(f"rank {r} is in two {name} groups")
                    index[r] = i
            if -1 in index:
                problems.append(f"rank {index.index(-1)} is in no {name} group")
            group_of[name] = index
        for a in NAMES:
            for b in NAMES:
                if a < b and len(set(zip(group_of[a], group_of[b], strict=True))) != self.gpus:
                    problems.append(f"axes {a} and {b} are not orthogonal: two ranks share "
                                    "a group of each")
        return problems

    def roles(self) -> list[int]:
        """The ranks to dry-run (module docstring)."""
        gen, sizes = self.generator, self.generator.sizes
        ranks = {0, self.gpus - 1}
        for axis, size in sizes.items():
            positions = range(size) if axis != "dp" else {0, size - 1}
            ranks.update(gen.rank({axis: i}) for i in positions)
        return sorted(ranks)

    def startup(self) -> dict[str, Any]:
        """The process groups start-up makes (comm.init): partitions of the world, groups,
        and NCCL communicator splits with `split_group` (one per partition) and without it
        (one per group, each joined by every rank of the world)."""
        parts = self.generator.partitions()
        made = [(names, groups) for names, groups in parts if len(groups) > 1]
        return {"partitions": [{"names": list(names), "groups": len(groups),
                                "ranks": len(groups[0])} for names, groups in parts],
                "groups": sum(len(groups) for _, groups in made),
                "splits": len(made),
                "splits_without_split_group": sum(len(groups) for _, groups in made),
                "communicators_per_rank": len(parts)}

    # ---------------------------------------------------------------- one rank
    def role(self, rank: int, memory: bool = True) -> Role:
        """Rank `rank` of the job, dry-run (module docstring)."""
        start = time.time()
        cfg = self.cfg
        with fake_world(self.gpus, rank):
            comm.init(cfg.parallel_order, **config_sizes(cfg))
            problems = group_problems(self.generator, rank)
            layout = Layout.of_groups(cfg, None, torch.device("cpu"))
            trace = trace_step(cfg, layout, self.local_batch, self.device_type)
            rows = memory_row(cfg, layout, self.local_batch, self.device_type) if memory else {}
            ddp = uses_ddp(cfg, layout)
        return Role(rank, self.generator.coords(rank), problems, trace, rows, layout.fsdp, ddp,
                    time.time() - start)

    def collective_rows(self, collectives: list[Collective]) -> list[dict[str, Any]]:
        """A step's collectives counted: op, axis, bytes, count, whether it crosses nodes."""
        counts = Counter((c.op, c.group, c.nbytes) for c in collectives)
        rows = [{"op": op, "axis": self.axis_of.get(group, "world"), "ranks": len(group),
                 "bytes": nbytes, "count": n,
                 "crosses_nodes": Placement.of(group, self.gpus_per_node).crosses_nodes}
                for (op, group, nbytes), n in counts.items()]
        return sorted(rows, key=lambda r: (r["axis"], r["op"], -r["bytes"]))

    def kind_of(self, role: Role):  # noqa: ANN201 - TimeModel.step's `kind_of`
        """How the library that calls each collective overlaps it (planning/time_model.py)."""
        def kind(call: Collective, axis: str, phase: str) -> str:
            if role.fsdp and axis == "dp" and call.op in ("all_gather", "reduce_scatter"):
                return "prefetch" if call.op == "all_gather" else "behind"
            if role.ddp and axis == "dp" and call.op == "all_reduce" and phase == "backward":
                return "behind"
            return "wait"
        return kind


def axis_names(generator: RankGenerator) -> dict[tuple[int, ...], str]:
    """Each group of the job (its ranks) -> the first name it serves ("tp" before "mp")."""
    names: dict[tuple[int, ...], str] = {}
    for partition_names, groups in generator.partitions():
        for group in groups:
            names.setdefault(tuple(group), partition_names[0])
    return names


def group_problems(generator: RankGenerator, rank: int) -> list[str]:
    """Where this rank's groups, as comm.init made them, differ from the generator's."""
    problems = []
    for name in GROUPS:
        want = generator.group_of(name, rank)
        got = (comm.get_size(name), comm.get_rank(name))
        if got != (len(want), want.index(rank)):
            problems.append(f"rank {rank}: {name} size and rank {got}, expected "
                            f"{(len(want), want.index(rank))}")
        elif len(want) > 1:
            members = dist.get_process_group_ranks(comm.get_group(name))
            if members != want:
                problems.append(f"rank {rank}: {name} group {members}, expected {want}")
    return problems
