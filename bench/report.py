"""bench_step's numbers: medians over rounds of ratios formed within a round, and the
tables it prints."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from bench.time_split import CATEGORIES


@dataclass
class Summary:
    label: str
    precision: str
    bare_sps: float
    full_sps: float
    overhead: float
    gflops: float
    mm_gflops: float | None  # the n^3 matmul ceiling of its precision (None: skipped)
    frac_mm: float | None
    shape_true_s: float | None  # None: skipped
    frac_shape_true: float | None
    rounds: int
    overhead_range: tuple[float, float]  # lowest and highest round
    frac_shape_true_range: tuple[float, float] | None


def summarise(label: str, precision: str, blocks: list[Any], batch: int,
              flops_per_sample: float) -> Summary:
    """Medians over rounds; ratios are formed within a round first."""
    med = statistics.median
    step_gflop = flops_per_sample * batch / 1e9
    overheads = [b.full_s / b.bare_s for b in blocks]
    fracs = [b.shape_true_s / b.full_s for b in blocks if b.shape_true_s is not None]
    mm = [b for b in blocks if b.mm_gflops]
    return Summary(
        label=label, precision=precision,
        bare_sps=med(batch / b.bare_s for b in blocks),
        full_sps=med(batch / b.full_s for b in blocks),
        overhead=med(overheads),
        gflops=med(step_gflop / b.full_s for b in blocks),
        mm_gflops=med(b.mm_gflops for b in mm) if mm else None,
        frac_mm=med(step_gflop / b.full_s / b.mm_gflops for b in mm) if mm else None,
        shape_true_s=med(b.shape_true_s for b in blocks) if fracs else None,
        frac_shape_true=med(fracs) if fracs else None, rounds=len(blocks),
        overhead_range=(min(overheads), max(overheads)),
        frac_shape_true_range=(min(fracs), max(fracs)) if fracs else None)


def _frac(x: float | None) -> str:
    return "skipped" if x is None else f"{x:.2f}"


def print_report(s: Summary) -> None:
    print(f"setting: {s.label} ({s.precision})")
    print(f"(b) bare step (in-memory batch): {s.bare_sps:.1f} samples/s")
    print(f"(c) full step (loader included): {s.full_sps:.1f} samples/s, "
          f"{s.gflops:.1f} model GFLOP/s")
    lo, hi = s.overhead_range
    print(f"framework overhead (c)/(b), time per step: {s.overhead:.3f} "
          f"(rounds: {lo:.3f} to {hi:.3f})")
    mm = "skipped" if s.mm_gflops is None else f"{s.mm_gflops:.1f} GFLOP/s"
    print(f"(a) n^3 matmul ceiling ({s.precision}): {mm}; (c) reaches {_frac(s.frac_mm)} of it")
    if s.frac_shape_true_range is None:
        print(f"(a) shape-true ceiling ({s.precision}): skipped")
        return
    lo, hi = s.frac_shape_true_range
    print(f"(a) shape-true ceiling ({s.precision}): {s.shape_true_s * 1e3:.1f} ms per step; "
          f"(c) reaches {s.frac_shape_true:.2f} of it (rounds: {lo:.2f} to {hi:.2f})")


def print_table(summaries: list[Summary]) -> None:
    print("| setting | precision | samples/s | overhead (c)/(b) | model GFLOP/s "
          "| of n^3 matmul ceiling | of shape-true ceiling |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for s in summaries:
        print(f"| {s.label} | {s.precision} | {s.full_sps:.1f} | {s.overhead:.3f} "
              f"| {s.gflops:.1f} | {_frac(s.frac_mm)} | {_frac(s.frac_shape_true)} |")


def print_split(splits: dict[str, dict[str, float]],
                ceiling_splits: dict[str, dict[str, float]]) -> None:
    """Shares of the full step by category (profiled), and the shape-true ceiling's own
    GEMM and attention time, for comparison."""
    print("time split of the full step (torch.profiler, share of the step):\n")
    print("| setting | " + " | ".join(CATEGORIES) + " | ceiling: GEMM ms / attention ms |")
    print("|---|" + "---:|" * (len(CATEGORIES) + 1))
    for label, shares in splits.items():
        c = ceiling_splits.get(label, {})
        cells = " | ".join(f"{100 * shares[k]:.0f} %" for k in CATEGORIES)
        print(f"| {label} | {cells} | {1e3 * c.get('gemm', 0):.1f} / "
              f"{1e3 * c.get('attention', 0):.1f} |")
