"""How long one training step takes on a GPU cluster: the time model, stated.

    model = TimeModel(gpu, network)                 # rates: planning/rates.py's defaults
    model = TimeModel(gpu, network, read_machine_file("machine.json"))  # measured rates
    split = model.step(trace.events, axes)    # a trace of planning/step_trace.py
    split.step_s, split.compute_s, split.exposed   # exposed: {axis: seconds}

Compute. Every operator of the step's trace runs for the longest of: its work at the rate
its kind and shape reach (planning/rates.py: a GEMM by its FLOPs and dtype, attention by
its key length, head dim and dtype), its bytes read and written at the rate an operator of
that size streams from HBM, and a kernel launch. Everything is then multiplied by one
`compute_factor` (1: the rates as they are), which one measured run calibrates
(`calibrate`; docs/scaling.md): what the tables miss (the host's dispatch between kernels,
clocks under load, the kernels the trace does not show).

Communication. A collective of S bytes (planning/collectives.py) over p ranks, per rank:

    all-reduce      ring 2 S (p-1)/p / B + 2 (p-1) a,   tree 2 S / B + 2 log2(p) a: the faster
    all-gather, reduce-scatter          S (p-1)/p / B + (p-1) a
    all-to-all      S (m-1)/p over the node's links and S (p-m)/p over this rank's NIC
    broadcast, reduce                   S / B + log2(p) a

B is the bus bandwidth of the group's slowest hop times `link_efficiency` (NCCL reaches
less than a link's peak): inside a node the NVLink bandwidth to the group's peers there;
across nodes the NICs of the group's m ranks on a node (each GPU has one; NCCL runs a ring
through each), at most the NVLink bandwidth. a is a step's latency, inside a node or across
(planning/machines.py).

Overlap, as each library does it (a GPU runs compute and communication at once; here each
axis's collectives share one link, in the order they are issued):
  - tensor, context and spatial collectives (the autograd Functions, the FFT's all-to-alls,
    the sums after backward): the compute waits for each: exposed;
  - DDP: each bucket's all-reduce starts when its last gradient is accumulated and the dp
    link is free; backward's end waits for the last;
  - FSDP2: a module's all-gather is issued one module ahead (in forward the CPU runs ahead
    of the GPU; in backward FSDP2 prefetches the next module's), so it starts when the
    module before it starts computing; the compute waits for it where it first reads the
    gathered parameters; reduce-scatters run behind the backward, waited for at its end.
Not here: the data loader, stragglers and jitter, per-epoch validation
(planning/scaling_terms.py adds them); communication slowing the compute it overlaps.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from planning.collectives import Collective
from planning.machines import Gpu, Network
from planning.rates import MachineRates, default_rates, dtype_key
from planning.step_trace import Compute, Phase, Ready, Wait

LINK_EFFICIENCY = 0.8  # NCCL's bus bandwidth against the links' peak (assumed)
FACTOR_RANGE = (0.05, 20.0)  # the compute factors calibration searches


@dataclass(frozen=True)
class Placement:
    """Where a group's ranks sit: how many nodes, and the most ranks it has on one."""

    ranks: int
    nodes: int
    per_node: int

    @classmethod
    def of(cls, group: tuple[int, ...], gpus_per_node: int) -> Placement:
        nodes = Counter(r // gpus_per_node for r in group)
        return cls(len(group), len(nodes), max(nodes.values()))

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


def ring_bytes(op: str, nbytes: float, ranks: int) -> float:
    """Bytes one rank sends in a ring (or pairwise) collective of S = `nbytes` over `ranks`:
    the textbook counts (all-reduce 2 S (p-1)/p; all-gather, reduce-scatter and all-to-all
    S (p-1)/p; broadcast and reduce S)."""
    if ranks == 1:
        return 0.0
    share = nbytes * (ranks - 1) / ranks
    return {"all_reduce": 2 * share, "all_gather": share, "reduce_scatter": share,
            "all_to_all": share, "broadcast": nbytes, "reduce": nbytes}.get(op, 0.0)


class TimeModel:
    """Step times of traces on `gpu`s joined by `network` (module docstring)."""

    def __init__(self, gpu: Gpu, network: Network, rates: MachineRates | None = None,
                 compute_factor: float = 1.0, gpus_per_node: int | None = None,
                 link_efficiency: float = LINK_EFFICIENCY,
                 calibrated_from: float | None = None):
        self.gpu, self.network = gpu, network
        self.rates = rates or default_rates(gpu)
        self.compute_factor = compute_factor
        self.gpus_per_node = gpus_per_node or network.gpus_per_node
        self.link_efficiency = link_efficiency
        self.calibrated_from = calibrated_from  # the measured samples/s, if calibrated

    def with_compute_factor(self, factor: float, calibrated_from: float | None = None
                            ) -> TimeModel:
        return TimeModel(self.gpu, self.network, self.rates, factor, self.gpus_per_node,
                         self.link_efficiency, calibrated_from)

    # ---------------------------------------------------------------- pieces
    def compute_s(self, op: Compute) -> float:
        if not (op.flops or op.nbytes):
            return 0.0  # metadata: no kernel
        rates, dtype = self.rates, dtype_key(op.dtype)
        work = 0.0
        if op.kind == "attention":
            work = op.flops / rates.attention(dtype, op.shape[3], op.shape[2])
        elif op.flops:
            work = op.flops / rates.gemm(dtype, op.flops)
        memory = op.nbytes / rates.memory(op.nbytes) if op.nbytes else 0.0
        return max(work, memory, rates.launch_s) * self.compute_factor

    def bandwidth(self, where: Placement) -> float:
        """The bus bandwidth of a group placed `where`: bytes/s each way per rank."""
        net = self.network
        inside = net.intra_bandwidth(where.per_node)
        if not where.crosses_nodes:
            return inside * self.link_efficiency
        across = net.nic * where.per_node
        return (min(across, inside) if where.per_node > 1 else across) * self.link_efficiency

    def collective_s(self, call: Collective) -> float:
        """Seconds one collective takes on each rank of its group (module docstring)."""
        where = Placement.of(call.group, self.gpus_per_node)
        p, S = where.ranks, float(call.nbytes)
        if p == 1:
            return 0.0
        hop = (self.network.hop_latency_inter if where.crosses_nodes
               else self.network.hop_latency_intra)
        B, log_p = self.bandwidth(where), math.ceil(math.log2(p))
        if call.op == "all_reduce":
            ring = ring_bytes("all_reduce", S, p) / B + 2 * (p - 1) * hop
            tree = 2 * S / B + 2 * log_p * hop
            return min(ring, tree)
        if call.op in ("all_gather", "reduce_scatter"):
            return ring_bytes(call.op, S, p) / B + (p - 1) * hop
        if call.op == "all_to_all":
            m = where.per_node
            inside = S * (m - 1) / p / (self.network.intra_bandwidth(m) * self.link_efficiency)
            across = S * (p - m) / p / (self.network.nic * self.link_efficiency)
            return max(inside, across) + (p - 1) * hop
        if call.op in ("broadcast", "reduce"):
            return S / B + log_p * hop
        return 2 * log_p * hop  # barrier and anything else: latency only

    # ---------------------------------------------------------------- a step
    def step(self, events: list[Any], axis_of: Mapping[tuple[int, ...], str],
             kind_of: Callable[[Collective, str, str], str]) -> StepSplit:
        """Simulate one step: the compute stream, and one link per axis (module docstring).
        `axis_of` names each group's axis; `kind_of(call, axis, phase)` says how its library
        overlaps a collective: "wait" (the compute waits at once: exposed), "prefetch"
        (FSDP's all-gathers: issued one module ahead, waited for where the compute first
        reads them) or "behind" (DDP's buckets, FSDP's reduce-scatters: waited for at
        backward's end)."""
        sim = _Simulation(self, axis_of, kind_of)
        for e in events:
            sim.handle[type(e)](e)
        return sim.end()

    def calibrate(self, samples_per_s: float, samples: int,
                  step_at: Callable[[float], float]) -> float:
        """The compute factor at which `step_at(factor)` (a step's seconds) makes a step of
        `samples` run at the measured `samples_per_s`: bisection (in log), the step time
        rising with the factor."""
        target = samples / samples_per_s
        lo, hi = FACTOR_RANGE
        if step_at(lo) > target:
            raise ValueError(f"faster than this model allows at {lo:g} x its rates: check "
                             "the config, flags, GPU and GPU count of the measured run")
        if step_at(hi) < target:
            raise ValueError(f"slower than {hi:g} x this model's compute: something else "
                             "(the data loader?) bounds the measured run")
        for _ in range(60):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if step_at(mid) < target else (lo, mid)
        return math.sqrt(lo * hi)


@dataclass(frozen=True)
class StepSplit:
    """One step's seconds: in all, computing, waiting for each axis's collectives
    (`exposed`), and each axis's link busy (`busy`, hidden or not)."""

    step_s: float
    compute_s: float
    exposed: dict[str, float]
    busy: dict[str, float]


class _Simulation:
    """The state of `TimeModel.step` as it walks a trace: the compute stream's clock, when
    each axis's link is free, and the collectives still to be waited for."""

    def __init__(self, model: TimeModel, axis_of: Mapping[tuple[int, ...], str],
                 kind_of: Callable[[Collective, str, str], str]):
        self.model, self.axis_of, self.kind_of = model, axis_of, kind_of
        self.clock = self.compute = self.segment_start = 0.0
        self.in_segment, self.phase = False, ""
        self.link_free: dict[str, float] = {}
        self.behind: dict[str, float] = {}  # axis -> when its last "behind" collective ends
        self.prefetched: dict[int, tuple[str, float]] = {}  # id(call) -> (axis, end)
        self.exposed: Counter = Counter()
        self.busy: Counter = Counter()
        self.handle = {Compute: self.on_compute, Wait: self.on_wait, Phase: self.on_phase,
                       Collective: self.on_collective, Ready: lambda e: None}

    def wait(self, axis: str, until: float) -> None:
        if until > self.clock:
            self.exposed[axis] += until - self.clock
            self.clock = until

    def on_compute(self, e: Compute) -> None:
        if not self.in_segment:
            self.segment_start, self.in_segment = self.clock, True
        dt = self.model.compute_s(e)
        self.clock += dt
        self.compute += dt

    def on_wait(self, e: Wait) -> None:
        if id(e.call) in self.prefetched:
            self.wait(*self.prefetched.pop(id(e.call)))

    def on_phase(self, e: Phase) -> None:
        self.phase = e.name
        if self.phase == "after backward":  # DDP's and FSDP's end-of-backward waits
            for axis, end in sorted(self.behind.items(), key=lambda kv: kv[1]):
                self.wait(axis, end)
            self.behind.clear()

    def on_collective(self, e: Collective) -> None:
        self.in_segment = False
        axis = self.axis_of.get(e.group, "world")
        kind = self.kind_of(e, axis, self.phase)
        dt = self.model.collective_s(e)
        self.busy[axis] += dt
        issued = self.segment_start if kind == "prefetch" else self.clock
        end = max(issued, self.link_free.get(axis, 0.0)) + dt
        self.link_free[axis] = end
        if kind == "behind":
            self.behind[axis] = max(self.behind.get(axis, 0.0), end)
        elif kind == "prefetch":
            self.prefetched[id(e)] = (axis, end)
        else:
            self.wait(axis, end)

    def end(self) -> StepSplit:
        """The step, once whatever it never read or waited for has ended too."""
        for axis, end in [*self.behind.items(), *self.prefetched.values()]:
            self.wait(axis, end)
        return StepSplit(self.clock, self.compute, dict(self.exposed), dict(self.busy))
