"""Where a training step's time goes, from `torch.profiler`: GEMM, attention, FFT,
elementwise and norm kernels, optimizer, data loader, and Python + framework (autograd
engine, dispatch, interpreter: the time in no kernel at all); and the elementwise + norm
time one level deeper, by cause and by operator.

Every profiled event's *self* time goes to exactly one category, so the shares add up to
the step's wall time on the training thread:
  optimizer, loader: everything under `Optimizer.step` / `Optimizer.zero_grad`, or under the
      benchmark's `LOADER_RANGE` (the wait for the next batch, whichever loader);
  GEMM: matmul and convolution kernels (ATen, oneDNN);
  attention: the scaled-dot-product attention kernels, forward and backward;
  FFT: the FFT kernels (the AFNO's spectral transforms);
  elementwise + norm: every other kernel (ATen ops, Inductor's fused C++ kernels);
  Python + framework: the rest (autograd nodes, compiled-graph wrappers, the step's own
      Python between kernels).
A loader thread or worker process is not on the training thread: what the step sees of it
is the wait in `LOADER_RANGE`.

The elementwise + norm time, by cause (`CAUSES`), first rule that applies:
  loss: the loss's own kernels, forward (under `LOSS_RANGE`) and backward (the autograd
      nodes of those forward ops, matched by sequence number);
  casts: dtype conversions: `aten::to` copies, autocast's and their backward
      (`ToCopyBackward0`), and Inductor kernels that only convert;
  norms, activations, softmax: LayerNorm, GELU/ReLU/shrinkage, softmax, forward and
      backward (an Inductor kernel that fuses one with other work counts as it: the work
      it rides along with would be a separate pass otherwise);
  layout reorders: copies that change the memory order (contiguous, clone of a transposed
      view, cat, stack, permute);
  adds, muls, sums: the remaining arithmetic (residual adds, the attention scale, bias
      gradients, gradient accumulation);
  copies: other copies and fills.
Inductor's kernels are named after the ATen ops they fuse (`cpp_fused__softmax_clone_..`),
which is what the rules read; `torch._inductor.config.cpp.enable_kernel_profile` must be on
when the model compiles, or the compiled graph's kernels show as one event each.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch.profiler import ProfilerActivity, record_function

from training.profiling import quiet_profile

STEP_RANGE = "bench: full step"
LOADER_RANGE = "bench: next batch"
LOSS_RANGE = "bench: loss"
CATEGORIES = ("GEMM", "attention", "FFT", "elementwise+norm", "optimizer", "loader",
              "Python+framework")
GEMM_NAMES = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_convolution",
              "aten::convolution", "aten::mkldnn_convolution", "aten::convolution_backward",
              "aten::mkldnn_convolution_backward", "aten::mkldnn_linear", "aten::_addmm_activation")
# Not "## Call CompiledFxGraph": with the kernel profile on, its self time is the compiled
# graph's Python wrapper, between the kernels it calls.
KERNEL_PREFIXES = ("aten::", "mkldnn::", "onednn::", "inductor::", "cpp_fused", "graph_")
CAUSES = ("casts", "layout reorders", "norms", "activations", "softmax", "loss",
          "adds, muls, sums", "copies")
# What an op or fused kernel's name must contain to be of a cause, in the order the rules
# are tried (after loss and the eager casts).
NAMED_CAUSES = (
    ("norms", ("layer_norm",)),
    ("activations", ("gelu", "relu", "softshrink", "threshold")),
    ("softmax", ("softmax",)),
    ("layout reorders", ("clone", "contiguous", "cat", "stack", "permute", "transpose")),
    ("adds, muls, sums", ("add", "mul", "sum", "div", "sub", "neg", "mean", "where", "pow",
                          "sqrt", "linalg_vector_norm")),
    ("casts", ("_to_copy", "convert_element_type")),
)
REORDER_PARENTS = ("aten::clone", "aten::contiguous", "aten::reshape", "aten::cat",
                   "aten::stack", "aten::_reshape_alias")


def category(name: str, ancestors: tuple[str, ...]) -> str:
    """The category of an event's self time; `ancestors` includes the event itself."""
    if any(a.startswith("Optimizer.") for a in ancestors):
        return "optimizer"
    if LOADER_RANGE in ancestors:
        return "loader"
    if name in GEMM_NAMES or "linear_pointwise" in name or name.startswith("mkldnn::_mm"):
        return "GEMM"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if name.startswith("aten::_fft_"):
        return "FFT"
    if name.startswith(KERNEL_PREFIXES):
        return "elementwise+norm"
    return "Python+framework"


def cause(name: str, ancestors: tuple[str, ...], in_loss: bool = False) -> str:
    """The cause of an elementwise + norm event (module docstring); `in_loss`: the event
    belongs to the loss (its forward range, or its backward's autograd nodes)."""
    if in_loss:
        return "loss"
    if name == "aten::_to_copy" or (name == "aten::copy_" and (
            "aten::_to_copy" in ancestors or any("ToCopyBackward" in a for a in ancestors))):
        return "casts"
    if name == "aten::copy_" and any(a in REORDER_PARENTS for a in ancestors[:-1]):
        return "layout reorders"
    ops = name.split("cpp_fused_", 1)[-1]
    for kind, words in NAMED_CAUSES:
        if any(w in ops for w in words):
            return kind
    return "copies"


@dataclass
class Split:
    """Seconds per step by category, and the elementwise + norm seconds by cause and by
    operator (an ATen op, or an Inductor kernel by its name)."""

    seconds: dict[str, float]
    causes: dict[str, float]
    ops: dict[str, float]
    cast_calls: float = 0.0  # eager dtype conversions per step (0 when compiled away)
    steps: int = 1
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.seconds.values()) or 1.0

    @property
    def shares(self) -> dict[str, float]:
        return {k: v / self.total for k, v in self.seconds.items()}

    def top_ops(self, n: int = 6) -> list[tuple[str, float]]:
        return sorted(self.ops.items(), key=lambda kv: -kv[1])[:n]


def _loss_sequence_numbers(roots: Iterable) -> set[int]:
    """Sequence numbers of the forward ops under `LOSS_RANGE`: their backward nodes carry
    the same numbers."""
    found: set[int] = set()

    def walk(e, inside: bool) -> None:
        inside = inside or e.name == LOSS_RANGE
        if inside and getattr(e, "sequence_nr", -1) >= 0:
            found.add(e.sequence_nr)
        for child in e.cpu_children:
            walk(child, inside)

    for root in roots:
        walk(root, False)
    return found


def split_events(events, steps: int = 1) -> Split:
    """The `Split` of the `STEP_RANGE` events and everything below them, per step."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    causes = dict.fromkeys(CAUSES, 0.0)
    ops: dict[str, float] = defaultdict(float)
    casts = 0
    roots = [e for e in events if e.name == STEP_RANGE]
    loss_seq = _loss_sequence_numbers(roots)

    def walk(e, ancestors: tuple[str, ...], in_loss: bool) -> None:
        nonlocal casts
        here = ancestors + (e.name,)  # optimizer and loader ranges own their Python time too
        in_loss = in_loss or e.name == LOSS_RANGE or (
            e.name.startswith("autograd::engine::evaluate_function")
            and getattr(e, "sequence_nr", -1) in loss_seq)
        seconds = e.self_cpu_time_total / 1e6
        kind = category(e.name, here)
        totals[kind] += seconds
        if kind == "elementwise+norm":
            why = cause(e.name, here, in_loss)
            causes[why] += seconds
            ops[e.name] += seconds
            casts += why == "casts" and e.name == "aten::_to_copy"
        for child in e.cpu_children:
            walk(child, here, in_loss)

    for root in roots:
        walk(root, (), False)
    n = max(steps, 1)
    return Split({k: v / n for k, v in totals.items()}, {k: v / n for k, v in causes.items()},
                 {k: v / n for k, v in ops.items()}, casts / n, n)


def profile_split(step: Callable[[], None], steps: int = 2) -> Split:
    """Run `step` `steps` times under the profiler; its `Split` per step."""
    with quiet_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function(STEP_RANGE):
                step()
    return split_events(prof.events(), steps)
