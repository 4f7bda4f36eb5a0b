"""The elementwise floor of a training step: the time its unavoidable elementwise and norm
work needs on this machine, the counterpart of the shape-true ceiling (bench/ceilings.py)
for everything that is not a GEMM, attention or FFT call.

Recorded from one eager forward and backward (a `TorchDispatchMode` sees every ATen call,
backward included), like the ceiling's calls. The calls the ceiling replays (GEMMs,
convolutions, attention, FFTs) cut the step's op stream into gaps; a gap's elementwise ops
(norms, activations, softmax, casts, reorders, adds, the loss) are taken as ONE fused pass,
which is what a perfect fusing compiler could at best make of them:
  - it reads every tensor that enters the gap once (GEMM outputs, saved activations,
    parameters, the batch), at the dtype it has;
  - it writes every tensor that leaves the gap once (read by a later call, saved for the
    backward, or a gradient); tensors made and used up inside the gap cost nothing;
  - it evaluates every transcendental function once per element (softmax's exp, GELU's
    erf, and erf and exp in its backward);
and takes max(bytes / bandwidth, transcendentals / rate) with the machine's measured
streaming bandwidth (at the size of the step's typical pass: the caches' when its tensors
fit in them) and exp/erf rate (`MachineRates`). Views cost nothing. The floor is the sum
over the gaps: a lower bound, since a pass that reads activations saved in the forward
streams them from memory. The optimizer has its own: Adam reads a parameter, its gradient
and two moments and writes three of them back, 28 bytes per fp32 parameter, from memory.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bench.ceilings import GEMM_OPS, is_attention, is_fft

aten = torch.ops.aten
BOUNDARY_OPS = GEMM_OPS | {aten.convolution.default, aten.convolution_backward.default}
# Transcendental evaluations per output element.
TRANSCENDENTAL = {"exp": 1, "erf": 1, "gelu": 1, "gelu_backward": 2, "_softmax": 1,
                  "_log_softmax": 1, "tanh": 1, "sigmoid": 1, "log": 1, "silu": 1}
ADAM_BYTES_PER_PARAM = 28  # reads p, g, m, v; writes p, m, v (fp32)


def is_boundary(func: Any) -> bool:
    """A call the shape-true ceiling replays (its time is not elementwise work)."""
    return func in BOUNDARY_OPS or is_attention(func) or is_fft(func)


@dataclass(frozen=True)
class Region:
    """A tensor as a call sees it: its storage, where in it, and how many bytes."""
    storage: int
    view: tuple
    nbytes: int
    storage_nbytes: int


def _region(t: torch.Tensor) -> Region | None:
    if t.numel() == 0 or t.layout != torch.strided:
        return None
    return Region(t.untyped_storage().data_ptr(),
                  (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype),
                  t.numel() * t.element_size(), t.untyped_storage().nbytes())


@dataclass
class Op:
    name: str
    kind: str  # "boundary", "view" or "work"
    reads: list[Region]
    writes: list[Region]
    transcendentals: int = 0


class PassRecorder(TorchDispatchMode):
    """Records every ATen call's tensors while active; keeps them alive, so that a storage
    address names one tensor's memory for the whole recording."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self._keep: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self._keep += ins + outs
        reads = [r for r in map(_region, ins) if r is not None]
        writes = [r for r in map(_region, outs) if r is not None]
        if is_boundary(func):
            kind = "boundary"
        elif not func._schema.is_mutable and writes and \
                {w.storage for w in writes} <= {r.storage for r in reads}:
            kind = "view"  # shares an input's memory: moves nothing
        elif func in (aten.empty.memory_format, aten.empty_strided.default,
                      aten.empty_like.default):
            kind = "view"  # allocates, writes nothing
        else:
            kind = "work"
        name = func._schema.name.split("::")[-1]
        elements = sum(t.numel() for t in outs)
        self.ops.append(Op(name, kind, reads, writes, TRANSCENDENTAL.get(name, 0) * elements))
        return out


@dataclass
class Gap:
    """One fused pass: the bytes it must move and the transcendentals it must evaluate."""
    read: int = 0
    written: int = 0
    transcendentals: int = 0
    ops: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.read + self.written


def gaps(ops: list[Op]) -> list[Gap]:
    """The fused passes of a recorded op stream (module docstring)."""
    readers: dict[int, list[int]] = defaultdict(list)
    for i, op in enumerate(ops):
        for r in op.reads:
            readers[r.storage].append(i)
    result, start = [], None
    for i, op in enumerate([*ops, Op("end", "boundary", [], [])]):
        if op.kind == "work" and start is None:
            start = i
        if op.kind == "boundary" and start is not None:
            result.append(_gap(ops, start, i, readers))
            start = None
    return result


def _gap(ops: list[Op], start: int, end: int, readers: dict[int, list[int]]) -> Gap:
    made: set[int] = set()  # storages written inside the gap so far
    read: dict[int, dict[tuple, int]] = defaultdict(dict)  # storage -> view -> bytes
    size: dict[int, int] = {}
    written: dict[int, int] = {}
    transcendentals = 0
    for op in ops[start:end]:
        if op.kind != "work":
            continue
        for r in op.reads:
            if r.storage not in made:
                read[r.storage][r.view] = r.nbytes
                size[r.storage] = r.storage_nbytes
        for w in op.writes:
            made.add(w.storage)
            written[w.storage] = max(written.get(w.storage, 0), w.nbytes)
        transcendentals += op.transcendentals
    leaving = sum(n for s, n in written.items()
                  if not readers[s] or any(j >= end for j in readers[s]))
    names = tuple(op.name for op in ops[start:end] if op.kind == "work")
    # Views of one tensor (q, k and v of qkv; a reshape) are read once: at most its size.
    entering = sum(min(sum(views.values()), size[s]) for s, views in read.items())
    return Gap(entering, leaving, transcendentals, names)


@dataclass
class MachineRates:
    """Streaming bandwidth (bytes/s: a fused read-read-write pass, as `torch.add`) over
    operands of `size_mb` (the step's typical pass) and over operands far larger than any
    cache (`memory_bandwidth`: what the optimizer's state streams at); transcendental rate
    (evaluations/s: the fastest of PyTorch's vectorised exp in fp32 and in bf16, and the
    erf of its GELU). All with every torch thread, best of a few calls."""

    bandwidth: float
    transcendental: float
    size_mb: float
    memory_bandwidth: float = 0.0

    @classmethod
    def measure(cls, size_mb: float = 8.0, tries: int = 5) -> MachineRates:
        bandwidth = _add_bandwidth(size_mb, tries)
        memory = _add_bandwidth(256.0, 2)
        x, y = torch.randn(2**20), torch.empty(2**20)
        xb, yb = x.bfloat16(), y.bfloat16()
        rate = x.numel() / min(_best(lambda: torch.exp(x, out=y), tries),
                               _best(lambda: torch.exp(xb, out=yb), tries),
                               _best(lambda: torch._C._nn.gelu(x, out=y), tries))
        return cls(bandwidth, rate, size_mb, memory)

    def describe(self) -> str:
        return (f"{self.bandwidth / 1e9:.0f} GB/s streaming ({self.size_mb:.0f} MB operands; "
                f"{self.memory_bandwidth / 1e9:.0f} GB/s from memory), "
                f"{self.transcendental / 1e9:.1f} G exp or erf per s")


def _add_bandwidth(size_mb: float, tries: int) -> float:
    n = int(size_mb * 2**20 / 4)
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    return 3 * n * 4 / _best(lambda: torch.add(a, b, out=c), tries)


def _best(fn: Callable[[], Any], tries: int) -> float:
    fn()
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass
class ElementwiseFloor:
    """The recorded passes of one step and their floor on this machine."""

    passes: list[Gap]
    params: int
    rates: MachineRates | None = None
    extra: dict[str, float] = field(default_factory=dict)

    @classmethod
    def record(cls, fwd_bwd: Callable[[], None], params: int) -> ElementwiseFloor:
        rec = PassRecorder()
        with rec:
            fwd_bwd()
        return cls(gaps(rec.ops), params)

    def seconds(self) -> float:
        r = self.rates
        return sum(max(g.nbytes / r.bandwidth, g.transcendentals / r.transcendental)
                   for g in self.passes)

    def optimizer_seconds(self) -> float:
        """Adam's state streams from memory: the step's activations pushed it out of the
        caches."""
        return self.params * ADAM_BYTES_PER_PARAM / (self.rates.memory_bandwidth
                                                     or self.rates.bandwidth)

    def describe(self) -> str:
        mb = sum(g.nbytes for g in self.passes) / 1e6
        t = sum(g.transcendentals for g in self.passes) / 1e6
        return f"{len(self.passes)} fused passes, {mb:.0f} MB, {t:.1f} M transcendentals"
