"""One training step of this rank, on fake tensors, written down for the time model.

    trace = trace_step(cfg, layout, local_batch)   # comm.init ran (on a fake world)
    trace.events        # in program order: Compute, Collective, phase and gradient marks
    trace.collectives   # every collective, DDP's bucket all-reduces included

The step is training/step.py's, on the model, optimizer and loss the train scripts build
for this layout (FSDP2 included), made of fake tensors: shapes and dtypes, nothing
computed. The kernels choose as on a GPU (networks/kernels.py). Two steps run; the second
is written down (Adam's state exists, as in every step after the first).

Every operator is counted as it passes (`StepTrace`, the collective recorder of
planning/collectives.py): matmul FLOPs by PyTorch's own formulas
(`torch.utils.flop_counter`), and the bytes every operator reads and writes (its tensor
arguments and results; views, allocations and metadata move nothing).

What a fake step cannot run is written down from what it shows:
  - DDP's bucketed all-reduce. DDP's reducer cannot run on fake tensors; after the first
    step DDP rebuilds its buckets in the order the gradients became ready, and all-reduces
    each as soon as its last gradient is: `ddp_buckets` asks PyTorch's own bucketing for
    that order and bucket cap, and each bucket's all-reduce is placed where its last
    gradient was accumulated (tests/test_dry_run.py compares them with a real DDP job);
  - under fp16, the loss scaler's overflow verdict agreed over the ranks that share a loss
    (a model's shards, an ensemble's members: `Layout.overflow_group`;
    distributed/loss_scaling.py): one 4-byte all-reduce per step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import flop_counter

import networks
from distributed import comm, fsdp
from distributed.layout import Layout
from networks import kernels
from planning.collectives import RESULTS, Collective, CollectiveRecorder, tensor_bytes
from training.run import run_loss
from training.step import Step
from utils.config_schema import Config
from utils.precision import Precision

# Operators that move no data: allocation, views PyTorch does not mark as views, metadata.
NO_TRAFFIC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
              "detach", "alias", "lift_fresh", "set_", "resize_", "record_stream",
              "_unsafe_view"}
# Attention on fake CPU tensors runs PyTorch's CPU flash kernel, which flop_counter does
# not list: its counts are the other flash kernels'.
SDPA_CPU = {"_scaled_dot_product_flash_attention_for_cpu": "forward",
            "_scaled_dot_product_flash_attention_for_cpu_backward": "backward"}


@dataclass(frozen=True)
class Compute:
    """One operator's work: matmul FLOPs (in `dtype`), and bytes read and written; its kind
    ("gemm", "attention" or "memory": everything else) and, for attention, its shape
    (batch x heads, query length, key length, head dim)."""

    flops: float
    nbytes: float
    dtype: torch.dtype | None  # the matmul's input dtype; None: no matmul
    kind: str = "memory"
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class Phase:
    """The step enters a range of training/step.py's profiler ranges."""

    name: str


@dataclass(frozen=True, eq=False)
class Wait:
    """The compute first reads the result of `call` (a collective earlier in the trace)."""

    call: Collective


@dataclass(frozen=True)
class Ready:
    """A parameter's gradient is accumulated (what DDP's reducer waits for)."""

    index: int  # in model.parameters()


@dataclass
class Trace:
    """A step's events in program order, and what it took to get them."""

    events: list[Any] = field(default_factory=list)
    local_batch: int = 0

    @property
    def collectives(self) -> list[Collective]:
        return [e for e in self.events if isinstance(e, Collective)]

    def flops(self) -> float:
        return sum(e.flops for e in self.events if isinstance(e, Compute))

    def nbytes(self) -> float:
        return sum(e.nbytes for e in self.events if isinstance(e, Compute))


class StepTrace(CollectiveRecorder):
    """Records collectives, every other operator's work (`Compute`), where the compute first
    reads a collective's result (`Wait`), phases and gradients becoming ready, in the order
    they happen."""

    def __init__(self, events: list[Any]) -> None:
        super().__init__()
        self.events = events
        self.unread: dict[int, Collective] = {}  # storage of a collective's result -> it

    def collective(self, call: Collective, named: dict[str, Any]) -> None:
        super().collective(call, named)
        self.events.append(call)
        for arg in RESULTS:
            for t in _tensors([named.get(arg)]):
                self.unread[_storage(t)] = call

    def other(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        name = func.overloadpacket.__name__
        if func.is_view or name in NO_TRAFFIC:
            return
        for t in _tensors([*args, *kwargs.values()]):
            call = self.unread.get(_storage(t))
            if call is not None:  # its first reader: what the compute waits for
                self.events.append(Wait(call))
                self.unread = {s: c for s, c in self.unread.items() if c is not call}
        flops, dtype = _flops(func, name, args, kwargs, out)
        kind, shape = _kind(name, args, flops)
        self.events.append(Compute(flops, _traffic(func, args, kwargs, out), dtype, kind, shape))


def _storage(t: torch.Tensor) -> int:
    """Which memory a (fake) tensor is made of: the same for all views of it."""
    return t.untyped_storage()._cdata


def _flops(func: Any, name: str, args: tuple, kwargs: dict, out: Any
           ) -> tuple[float, torch.dtype | None]:
    """(matmul FLOPs, input dtype) of one operator; (0, None) for any other."""
    if name in SDPA_CPU:
        if SDPA_CPU[name] == "forward":
            q, k, v = args[:3]
            return flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape), q.dtype
        grad, q, k, v = args[:4]
        return (flop_counter.sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape),
                q.dtype)
    formula = flop_counter.flop_registry.get(func.overloadpacket)
    if formula is None:
        return 0.0, None
    first = next(a for a in args if isinstance(a, torch.Tensor))
    return float(formula(*args, **kwargs, out_val=out)), first.dtype


def _kind(name: str, args: tuple, flops: float) -> tuple[str, tuple[int, ...]]:
    """The operator's kind for the time model, and an attention's shape (`Compute`)."""
    if name in SDPA_CPU:
        q, k = args[:2] if SDPA_CPU[name] == "forward" else args[1:3]
        return "attention", (math.prod(q.shape[:-2]), q.shape[-2], k.shape[-2], q.shape[-1])
    return ("gemm", ()) if flops else ("memory", ())


def _traffic(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """Bytes an operator reads (its tensor arguments) and writes (its results that are new
    tensors, and the arguments it writes in place). An operator that writes nothing asks
    about its arguments (their device, size): it reads no data either."""
    inputs = [*args, *kwargs.values()]
    seen = {id(t) for t in _tensors(inputs)}
    written = sum(tensor_bytes(a) for a, spec in zip(args, func._schema.arguments, strict=False)
                  if spec.alias_info is not None and spec.alias_info.is_write)
    new = sum(tensor_bytes(t) for t in _tensors([out]) if id(t) not in seen)
    if not written and not any(True for _ in _tensors([out])):
        return 0.0
    return float(tensor_bytes(inputs) + written + new)


def _tensors(values: list[Any]) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(list(v))


class Phases:
    """Stands in for the step's profiler (training/profiling.py): each range it opens is a
    `Phase` in the trace (and what runs after a range, before the next, is "after" it)."""

    def __init__(self, events: list[Any]):
        self.events = events

    @contextlib.contextmanager
    def range(self, name: str) -> Iterator[None]:
        self.events.append(Phase(name))
        try:
            yield
        finally:
            self.events.append(Phase(f"after {name}"))


def step_run(cfg: Config, layout: Layout, model: nn.Module, optimizer: torch.optim.Optimizer,
             prof: Any, device_type: str) -> SimpleNamespace:
    """What training/step.py's step reads of a run (`training.run.Training`): the model,
    optimizer, layout, profiler, precision (autocast as on `device_type`'s kernels, on CPU
    tensors), the config's loss and an ensemble's members; no loss scaling (its verdict
    reads a value)."""
    mode = cfg.amp_mode
    if mode == "auto":  # every GPU the planner knows runs bf16 natively; a CPU here: fp32
        mode = "bf16" if device_type == "cuda" else "none"
    tile = layout.tile.shape
    return SimpleNamespace(
        model=model, optimizer=optimizer, layout=layout, prof=prof,
        ctx=SimpleNamespace(precision=Precision(mode, "cpu")),
        loss=run_loss(cfg, layout, torch.ones(tile[0])),
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        members=layout.members(cfg), progress=SimpleNamespace(iters=0))


def batch(cfg: Config, layout: Layout, local_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (input, target) batch of this rank's tile (random numbers: the step reads none)."""
    target = ((cfg.rollout_steps,) if cfg.rollout_steps > 1 else ()) + (cfg.n_out_channels,)
    return (torch.randn(local_batch, cfg.n_in_channels, *layout.tile.shape),
            torch.randn(local_batch, *target, *layout.tile.shape))


def uses_ddp(cfg: Config, layout: Layout) -> bool:
    """Whether the train scripts wrap this layout's model in DDP (training/run.py)."""
    return not layout.fsdp and comm.get_size("dp") > 1 and not cfg.noddp


def trace_step(cfg: Config, layout: Layout, local_batch: int,
               device_type: str = "cuda") -> Trace:
    """This rank's second training step on fake tensors (module docstring); comm.init ran."""
    from planning.memory import _optimizer  # the planner's Adam, as on `device_type`

    trace = Trace(local_batch=local_batch)
    with fake_model(cfg, layout, device_type) as model:
        params = list(model.parameters())
        if uses_ddp(cfg, layout):
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(
                    lambda _, i=i: trace.events.append(Ready(i)))
        run = step_run(cfg, layout, model, _optimizer(cfg, model, device_type),
                       Phases([]), device_type)
        inp, tar = batch(cfg, layout, local_batch)
        Step()(run, inp, tar)
        trace.events.clear()
        run.prof = Phases(trace.events)
        with StepTrace(trace.events):
            Step()(run, inp, tar)
    if uses_ddp(cfg, layout):
        trace.events = with_ddp_buckets(trace.events, params, cfg.bucket_cap_mb)
    if cfg.amp_mode == "fp16" and (layout.shares_loss or layout.fsdp):
        trace.events = with_overflow_verdict(trace.events, layout)
    return trace


@contextlib.contextmanager
def fake_model(cfg: Config, layout: Layout, device_type: str = "cuda") -> Iterator[nn.Module]:
    """The model this rank trains, FSDP2 included, made of fake tensors, for the duration
    (the fake mode stays on: what runs inside computes nothing); comm.init ran."""
    with torch.device("meta"):
        model = networks.build_model(cfg, layers=layout.layers)
    mesh = fsdp.mesh_of(comm.get_group("dp"), torch.device("cpu")) if layout.fsdp else None
    try:
        with torch.random.fork_rng(devices=[]), FakeTensorMode(allow_non_fake_inputs=True), \
                kernels.as_on(device_type):
            with fsdp.keep_annotations(model):
                model.to_empty(device="cpu")
            if mesh is not None:
                model = fsdp.shard_model(model, mesh,
                                         reshard_after_forward=not cfg.no_reshard_after_forward)
            yield model
    finally:
        # Fake tensors' dispatch cache keeps a collective's outputs, and with them its
        # process group, which comm.shutdown() then cannot free.
        FakeTensorMode.cache_clear()


def ddp_buckets(params: list[torch.Tensor], ready: list[int], bucket_cap_mb: int
                ) -> list[list[int]]:
    """The buckets (lists of parameter indices) DDP rebuilds after its first step, from the
    order in which the gradients became ready (PyTorch's own assignment)."""
    cap = int(bucket_cap_mb * 1024 * 1024)
    # The first bucket's cap: the bucket cap itself when bucket_cap_mb is given (PyTorch
    # 2.13's DDP), its default first bucket of 1 MiB before.
    ddp = torch.nn.parallel.distributed
    first = cap if hasattr(ddp, "_BucketCapacityConfig") else dist._DEFAULT_FIRST_BUCKET_BYTES
    tensors = [params[i] for i in ready]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [first, cap],
                                                         [False] * len(tensors), ready)
    return [list(b) for b in buckets]


def with_ddp_buckets(events: list[Any], params: list[torch.Tensor],
                     bucket_cap_mb: int) -> list[Any]:
    """`events` with DDP's all-reduce of each bucket over dp, where its last gradient
    became ready (module docstring)."""
    at = {e.index: n for n, e in enumerate(events) if isinstance(e, Ready)}
    ready = sorted(at, key=at.get)
    group = tuple(dist.get_process_group_ranks(comm.get_group("dp")))
    placed: dict[int, list[Collective]] = {}
    for bucket in ddp_buckets(params, ready, bucket_cap_mb):
        nbytes = sum(params[i].numel() * params[i].element_size() for i in bucket)
        placed.setdefault(max(at[i] for i in bucket), []).append(
            Collective("all_reduce", group, nbytes))
    out = []
    for n, e in enumerate(events):
        out.append(e)
        out.extend(placed.get(n, []))
    return out


def with_overflow_verdict(events: list[Any], layout: Layout) -> list[Any]:
    """`events` with fp16's overflow verdict, agreed over the group `Layout.grad_scaler`
    names (a found-inf flag of 4 bytes, all-reduced with MAX), at the optimizer's start."""
    group = layout.overflow_group or dist.group.WORLD
    call = Collective("all_reduce", tuple(dist.get_process_group_ranks(group)), 4)
    n = next((n for n, e in enumerate(events) if e == Phase("optimizer")), len(events))
    return [*events[:n + 1], call, *events[n + 1:]]
