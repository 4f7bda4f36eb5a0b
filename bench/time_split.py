"""Where a training step's time goes, from `torch.profiler`: GEMM, attention, elementwise and
norm kernels, optimizer, data loader, and Python + framework (autograd engine, dispatch,
interpreter: the time in no kernel at all).

Every profiled event's *self* time goes to exactly one category, so the shares add up to
the step's wall time on the training thread:
  optimizer, loader: everything under `Optimizer.step` / `Optimizer.zero_grad`, or under the
      benchmark's `LOADER_RANGE` (the wait for the next batch, whichever loader);
  GEMM: matmul and convolution kernels (ATen, oneDNN);
  attention: the scaled-dot-product attention kernels, forward and backward;
  elementwise + norm: every other kernel (ATen ops, Inductor's fused C++ kernels);
  Python + framework: the rest (autograd nodes, compiled-graph wrappers, the step's own
      Python between kernels).
A loader thread or worker process is not on the training thread: what the step sees of it
is the wait in `LOADER_RANGE`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile, record_function

STEP_RANGE = "bench: full step"
LOADER_RANGE = "bench: next batch"
CATEGORIES = ("GEMM", "attention", "elementwise+norm", "optimizer", "loader",
              "Python+framework")
GEMM_NAMES = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_convolution",
              "aten::convolution", "aten::mkldnn_convolution", "aten::convolution_backward",
              "aten::mkldnn_convolution_backward", "aten::mkldnn_linear", "aten::_addmm_activation")
KERNEL_PREFIXES = ("aten::", "mkldnn::", "onednn::", "inductor::", "## Call CompiledFxGraph",
                   "cpp_fused", "graph_")


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
    if name.startswith(KERNEL_PREFIXES):
        return "elementwise+norm"
    return "Python+framework"


def split_events(events) -> dict[str, float]:
    """Seconds per category over the `STEP_RANGE` events and everything below them."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    roots = [e for e in events if e.name == STEP_RANGE]

    def walk(e, ancestors: tuple[str, ...]) -> None:
        here = ancestors + (e.name,)  # optimizer and loader ranges own their Python time too
        totals[category(e.name, here)] += e.self_cpu_time_total / 1e6
        for child in e.cpu_children:
            walk(child, here)

    for root in roots:
        walk(root, ())
    return totals


def profile_split(step: Callable[[], None], steps: int = 2) -> dict[str, float]:
    """Run `step` `steps` times under the profiler; the share of each category."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function(STEP_RANGE):
                step()
    seconds = split_events(prof.events())
    total = sum(seconds.values()) or 1.0
    return {k: v / total for k, v in seconds.items()}
