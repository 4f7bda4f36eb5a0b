"""What one rank holds at its peak in a layout, before the job runs: the memory planner's
estimate (`python -m bench.memory_plan` lists every layout of a config; train.py and
train_mp.py log the estimate of their own layout beside the measured peak).

    estimate = trace_layout(cfg, layout, local_batch=16, device_type="cuda")
    estimate.peak, estimate.parts, estimate.after_forward      # bytes on this rank

How (PyTorch's own memory tracking, not hand-counted bytes):
  - the model is built with the layout's layers on the meta device, then made of fake
    tensors (`FakeTensorMode`: shapes and dtypes, no data, no compute) on the CPU, sharded
    by FSDP2 if the layout says so; the kernels choose as on `device_type`
    (networks/kernels.py: on a GPU, fp16/bf16 flash attention and the patch convolution);
  - training/step.py's own step runs twice on a fake batch (the second with Adam's state),
    under `MemTracker` (`FSDPMemTracker` under FSDP), which sorts every tensor alive into
    parameters, gradients, optimizer state, activations (and temporaries) and, under FSDP,
    the all-gather and reduce-scatter buffers; the step's profiler ranges (forward,
    backward, gradient sums over mp and ens, optimizer) mark its phases, and the
    tracker keeps the peak of each;
  - collectives on fake tensors move nothing: one rank traces alone, on the process groups
    of a running job or on a fake world of any size (planning/fake_world.py); traced as on
    a CPU, gloo's all-gather and reduce-scatter add the temporary they copy through;
  - every block holds the same shapes, so in each phase every part is an affine function
    of the depth: a deep model is traced at depths 3 and 4 and each phase's peak
    extrapolated to the config's depth (the phase with the largest total is the peak);
  - DDP's gradient buckets (one buffer of every gradient, made in C++ when DDP wraps the
    model; fake tensors cannot build DDP) are added to the communication buffers. The loss
    scaler's step (it reads its overflow flag on the host) is left out: it unscales in
    place. torch.compile is not traced: the estimate is for the eager step;
  - in the precision the run computes in: `amp_mode: auto` is what it picks on
    `device_type` (bf16 on a GPU that runs it natively).
  - at each phase's peak, what the GPU's caching allocator would add by rounding every live
    tensor up (`ROUNDING`).
What no tensor shows on a GPU (the CUDA context, the kernels, NCCL's and DALI's buffers, the
allocator's workspaces and fragmentation) is planning/memory_terms.py's, term by term, and
the CPU estimate is checked against the allocations of real runs in every layout
(tests/test_memory_plan.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import networks
from distributed import comm, fsdp
from distributed.layout import Layout
from networks import kernels
from planning.memory_terms import block_bytes
from training.run import run_loss
from training.step import Step
from utils.config_schema import Config
from utils.precision import Precision, auto_amp_mode

log = logging.getLogger("train")

GIB = 1024**3
PARTS = ("parameters", "gradients", "optimizer", "activations", "communication")
# MemTracker's and FSDPMemTracker's kinds of tensor, by the part of the estimate they are.
KINDS = {"Parameter": "parameters", "Buffer": "parameters", "Sharded Param": "parameters",
         "Unsharded Param": "parameters", "Gradient": "gradients",
         "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
         "Optstate": "optimizer", "OptState": "optimizer", "Activation": "activations",
         "Temp": "activations", "Inputs": "activations", "Other": "activations",
         "All Gather": "communication", "Reduce Scatter": "communication"}
# The peak's bytes the caching allocator adds by rounding each live tensor up
# (planning/memory_terms.py `block_bytes`), kept beside the parts of each phase's peak.
ROUNDING = "allocator rounding"

# Deeper models are extrapolated from these two depths: from depth 3 on, each added block
# adds the same bytes to every phase's peak (at depth 2 the backward of a recomputing model
# still peaks elsewhere).
TRACED_DEPTHS = (3, 4)


@dataclass(frozen=True)
class Estimate:
    """Bytes on one rank: `parts` at the peak (PARTS), in which phase of which step the peak
    is, the first step's peak, and the peak up to the end of the first forward pass (what
    the tutorial's logs print: no gradients or optimizer state exist yet), and the bytes
    the GPU's caching allocator adds at the peak by rounding (planning/memory_terms.py)."""

    parts: dict[str, float]
    phase: str
    first_step: float
    after_forward: float
    rounding: float = 0.0

    @property
    def peak(self) -> float:
        return sum(self.parts.values())

    def plus(self, part: str, nbytes: float) -> Estimate:
        """With `nbytes` more of `part`, held the whole time (DDP's buckets)."""
        return replace(self, parts={**self.parts, part: self.parts[part] + nbytes},
                       first_step=self.first_step + nbytes,
                       after_forward=self.after_forward + nbytes)


class _PhasePeaks:
    """Mixed into MemTracker: the peak snapshot of each (step, phase) instead of each
    module's (per-module peaks cost a pass over every module at every operation)."""

    def start_phase_tracking(self) -> None:
        self.where: tuple[int, str] = (0, "set-up")
        self.peaks: dict[tuple[int, str], dict[str, int]] = {}

    def _update_peak_stats(self, peak_state) -> None:  # noqa: ANN001 - MemTracker's hook
        for snapshot in self._curr_mem_snap.values():  # one device: the fake CPU
            best = self.peaks.get(self.where)
            if best is None or snapshot["Total"] > best["Total"]:
                self.peaks[self.where] = {**snapshot, ROUNDING: self._rounding()}

    def _rounding(self) -> int:
        """What the caching allocator adds to the live tensors (MemTracker's `_WINFO`:
        every storage it tracks, with its size)."""
        extra = 0
        for winfo, _ in getattr(self, "_WINFO", {}).values():
            nbytes = winfo.size * winfo.element_size
            extra += block_bytes(nbytes) - nbytes if nbytes else 0
        return extra


def _tracker(model: nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool) -> _PhasePeaks:
    """A MemTracker (FSDPMemTracker under FSDP) that keeps the peak of each phase. Imported
    here, not at the top: importing them sets TORCHINDUCTOR_CACHE_DIR to Inductor's /tmp
    default, and a job that compiles chooses its cache first (training/compiling.py)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if fsdp:
        return type("_FSDPTracker", (_PhasePeaks, FSDPMemTracker), {})(model, optimizer)
    return type("_Tracker", (_PhasePeaks, MemTracker), {})()


class _GlooCopies(TorchDispatchMode):
    """Gloo's all-gather and reduce-scatter go through a temporary the size of the whole
    (the gathered output; the input being scattered), allocated by PyTorch's allocator for
    the collective's duration (all-reduce and all-to-all work in place); NCCL needs none.
    Traced as on a CPU, each such collective allocates it, inside the tracker."""

    WHOLE = {"c10d._allgather_base_.default": 0, "c10d._reduce_scatter_base_.default": 1}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - the hook
        which = self.WHOLE.get(str(func))
        copy = torch.empty_like(args[which]) if which is not None else None
        try:
            return func(*args, **(kwargs or {}))
        finally:
            del copy


class _Phases:
    """Stands in for the step's profiler (training/profiling.py): its ranges name the
    phase the tracker is in."""

    def __init__(self, tracker: _PhasePeaks):
        self.tracker = tracker

    @contextlib.contextmanager
    def range(self, name: str) -> Iterator[None]:
        step = self.tracker.where[0]
        self.tracker.where = (step, name)
        try:
            yield
        finally:  # the step's ranges follow each other: what runs between is after this one
            self.tracker.where = (step, f"after {name}")


def run_amp_mode(amp_mode: str, device_type: str) -> str:
    """What `amp_mode` computes in on a `device_type` device: 'auto' is bf16 on a GPU (every
    GPU the tutorial sizes for runs it natively) and this CPU's choice on a CPU."""
    if amp_mode != "auto":
        return amp_mode
    return "bf16" if device_type == "cuda" else auto_amp_mode(torch.device("cpu"))


def trace_layout(cfg: Config, layout: Layout, local_batch: int,
                 device_type: str = "cuda", amp_mode: str | None = None) -> Estimate:
    """This rank's estimate for `cfg` in `layout` (its process groups must exist:
    comm.init ran) with `local_batch` samples, the kernels choosing as on `device_type`,
    computing in `amp_mode` (default: what the config's runs in there, `run_amp_mode`)."""
    depths = [cfg.depth] if cfg.depth <= TRACED_DEPTHS[-1] else list(TRACED_DEPTHS)
    amp_mode = amp_mode or run_amp_mode(cfg.amp_mode, device_type)
    try:
        with torch.random.fork_rng(devices=[]):  # the run's random numbers stay untouched
            peaks = [_trace(cfg.replace(depth=d, amp_mode=amp_mode), layout, local_batch,
                            device_type)
                     for d in depths]
    finally:
        # Fake tensors' dispatch cache (one for the process) keeps a collective's outputs,
        # and with them its process group, which comm.shutdown() then cannot free.
        FakeTensorMode.cache_clear()
    if len(peaks) == 2:  # every (step, phase) peak's parts: affine in the depth
        (d0, at0), (d1, at1) = zip(depths, peaks, strict=True)
        peaks = [{where: {part: at0[where][part] + (cfg.depth - d0) / (d1 - d0)
                          * (at1[where][part] - at0[where][part]) for part in at0[where]}
                  for where in at0}]
    estimate = _estimate(peaks[0])
    buckets = _ddp_buckets(cfg, layout)
    return estimate.plus("communication", buckets) if buckets else estimate


def _trace(cfg: Config, layout: Layout, local_batch: int,
           device_type: str) -> dict[tuple[int, str], dict[str, float]]:
    """The parts of the peak of every (step, phase) of two steps: {(step, phase): {part:
    bytes}}."""
    with torch.device("meta"):
        model = networks.build_model(cfg, layers=layout.layers)
    # The mesh of real ranks, made before the fake tensors (it reads the group's ranks).
    mesh = fsdp.mesh_of(comm.get_group("dp"), torch.device("cpu")) if layout.fsdp else None
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # the meta model is made fake here
    with mode, kernels.as_on(device_type):
        with fsdp.keep_annotations(model):
            model.to_empty(device="cpu")
        if mesh is not None:
            model = fsdp.shard_model(model, mesh,
                                     reshard_after_forward=not cfg.no_reshard_after_forward)
        optimizer = _optimizer(cfg, model, device_type)
        tracker = _tracker(model, optimizer, layout.fsdp)
        if not layout.fsdp:
            tracker.track_external(model, optimizer)
        tracker.start_phase_tracking()
        tile = layout.tile.shape
        run = SimpleNamespace(  # amp_mode: the run's, resolved by trace_layout
            model=model, optimizer=optimizer, layout=layout, prof=_Phases(tracker),
            ctx=SimpleNamespace(precision=Precision(cfg.amp_mode, "cpu")),
            loss=run_loss(cfg, layout, torch.ones(tile[0])),
            scaler=torch.amp.GradScaler("cpu", enabled=False),
            members=layout.members(cfg), progress=SimpleNamespace(iters=0))
        target = ((cfg.rollout_steps,) if cfg.rollout_steps > 1 else ()) + (cfg.n_out_channels,)
        step = Step()
        gloo = _GlooCopies() if device_type == "cpu" else contextlib.nullcontext()
        with tracker, gloo:
            inp = torch.randn(local_batch, cfg.n_in_channels, *tile)  # a batch on the device
            tar = torch.randn(local_batch, *target, *tile)
            for i in range(2):
                tracker.where = (i, "set-up")
                step(run, inp, tar)
                tracker.reset_mod_stats()  # MemTracker follows modules one step at a time
    peaks = {where: _parts(snapshot) for where, snapshot in tracker.peaks.items()}
    if layout.fsdp:
        # Adam's first step creates its state, and under fake tensors DTensor's sharding
        # propagation of that creates whole-tensor fakes the tracker counts and a real run
        # never allocates; the second step's optimizer phase holds the same tensors.
        peaks[(0, "optimizer")] = peaks[(1, "optimizer")]
    return peaks


def _parts(snapshot: dict) -> dict[str, float]:
    """A tracker snapshot {kind: bytes} as the estimate's parts (PARTS) and ROUNDING."""
    parts = dict.fromkeys(PARTS, 0.0)
    for kind, nbytes in snapshot.items():
        if kind not in ("Total", ROUNDING):
            parts[KINDS[str(getattr(kind, "value", kind))]] += nbytes
    return {**parts, ROUNDING: float(snapshot.get(ROUNDING, 0))}


def _optimizer(cfg: Config, model: nn.Module, device_type: str) -> torch.optim.Optimizer:
    """training.run's Adam, run as on `device_type`: fused if the config says so, else
    PyTorch's default there (foreach on a GPU: its temporaries are the size of the
    parameters)."""
    from training.run import build_optimizer

    optimizer = build_optimizer(cfg, model)
    if device_type == "cuda" and not cfg.enable_fused:
        for group in optimizer.param_groups:
            group["foreach"] = True
    return optimizer


def _estimate(peaks: dict[tuple[int, str], dict[str, float]]) -> Estimate:
    """The peak's parts (the (step, phase) with the largest total), the first step's peak
    and the peak up to the end of the first forward pass."""
    totals = {where: sum(parts[p] for p in PARTS) for where, parts in peaks.items()}
    where = max(totals, key=totals.get)
    before_backward = [t for (step, phase), t in totals.items()
                       if step == 0 and phase in ("set-up", "forward")]
    return Estimate({p: peaks[where][p] for p in PARTS}, f"step {where[0] + 1}, {where[1]}",
                    max(t for (step, _), t in totals.items() if step == 0),
                    max(before_backward), peaks[where].get(ROUNDING, 0.0))


def _ddp_buckets(cfg: Config, layout: Layout) -> float:
    """Bytes of DDP's gradient buckets on this rank: every gradient once more (0 without
    DDP: FSDP, one data-parallel rank, noddp)."""
    if layout.fsdp or comm.get_size("dp") == 1 or cfg.noddp:
        return 0.0
    with torch.device("meta"):
        model = networks.build_model(cfg, layers=layout.layers)
    return float(sum(p.numel() * p.element_size() for p in model.parameters()))


def step_memory_line(cfg: Config, layout: Layout, local_batch: int, amp_mode: str,
                     measured: dict[str, float], step: int,
                     how: str = "its own peak, reset once warm") -> str:
    """The log line of a warm step's memory (`step`, the second this process runs; the
    peak was reset just before it): `measured` (training.setup.memory_since_reset:
    on a GPU the tensors' and the allocator's peaks, on a CPU the resident set; `how` it
    was measured, `Step.measured_memory`) beside this estimate of the tensors' peak, traced
    in the run's precision `amp_mode`. Only the logging
    rank traces (seconds); an estimate that cannot be traced says why in the line and never
    stops the run. Not under FSDP: its trace on the job's own dp group leaves FSDP state
    that keeps the group alive past comm.shutdown() (`python -m bench.memory_plan` traces FSDP
    on a fake world instead)."""
    parts = ", ".join(f"{gb:.2f} GB {what}" for what, gb in measured.items())
    line = f"Memory of step {step} ({how}): {parts}"
    if comm.get_world_rank() != 0:
        return line
    if layout.fsdp:  # a trace of FSDP2 on the job's own dp group keeps that group alive
        return f"{line}; planner: `python -m bench.memory_plan` (FSDP is not traced in a job)"
    try:
        estimate = trace_layout(cfg, layout, local_batch, layout.device.type, amp_mode)
    except Exception as e:  # noqa: BLE001 - an estimate must never stop the training
        return f"{line}; planner: no estimate ({type(e).__name__}: {str(e)[:80]})"
    how = f"eager step, {'fp32' if amp_mode == 'none' else amp_mode}"
    how += "; this run compiles" if cfg.enable_jit else ""
    return (f"{line}; planner's estimate of the tensors {estimate.peak / GIB:.3g} GB "
            f"({how}; planning/memory.py)")
