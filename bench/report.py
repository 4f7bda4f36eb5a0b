"""bench_step's numbers: medians over rounds of ratios formed within a round, and the
tables it prints."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

from bench.time_split import CAUSES, Split
from utils.precision import precision_line


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
    batch: int = 1
    first_step_s: float = float("nan")  # set-up + first step (compile included)

    @property
    def step_s(self) -> float:
        """Median seconds of a full step."""
        return self.batch / self.full_sps


def summarise(label: str, precision: str, blocks: list[Any], batch: int,
              flops_per_sample: float, first_step_s: float = float("nan")) -> Summary:
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
        frac_shape_true_range=(min(fracs), max(fracs)) if fracs else None, batch=batch,
        first_step_s=first_step_s)


def _frac(x: float | None) -> str:
    return "skipped" if x is None else f"{x:.2f}"


def print_report(s: Summary) -> None:
    print(f"setting: {s.label} ({s.precision})")
    print(f"(b) bare step (in-memory batch): {s.bare_sps:.1f} samples/s")
    print(f"(c) full step (loader included): {s.full_sps:.1f} samples/s, "
          f"{s.gflops:.1f} model GFLOP/s; set-up and first step {s.first_step_s:.1f} s")
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
    print("| setting | precision | samples/s | first step [s] | overhead (c)/(b) "
          "| model GFLOP/s | of n^3 matmul ceiling | of shape-true ceiling |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for s in summaries:
        print(f"| {s.label} | {s.precision} | {s.full_sps:.1f} | {s.first_step_s:.1f} "
              f"| {s.overhead:.3f} | {s.gflops:.1f} | {_frac(s.frac_mm)} "
              f"| {_frac(s.frac_shape_true)} |")


def print_precisions(modes: list[str], config: str, summaries: list[Summary],
                     device: torch.device) -> None:
    """Each precision's line (what train.py says at start-up), the table, and each
    precision's speed against the first one's, measured side by side (README step 5)."""
    for mode in dict.fromkeys(modes):
        print(precision_line(mode, device, config=config)[1])
    print()
    print_table(summaries)
    first = summaries[0]
    for s in summaries[1:]:
        ratio = s.full_sps / first.full_sps
        print(f"\n'{s.label}' against '{first.label}': {ratio:.2f}x the samples/s, a step "
              f"{1 / ratio:.{2 if ratio > 1 else 1}f}x as long")


@dataclass
class Limits:
    """A setting's own limits, seconds per step: the shape-true ceiling (GEMM, attention,
    FFT calls), the elementwise floor and the optimizer's floor (bench/floor.py)."""
    ceiling: dict[str, float]
    elementwise: float
    optimizer: float


def _ms(x: float) -> str:
    return f"{1e3 * x:.1f}"


def print_split(splits: dict[str, Split], summaries: dict[str, Summary],
                limits: dict[str, Limits]) -> None:
    """Where the full step's time goes (profiled shares of the median full step), each part
    against its own limit; then the elementwise + norm time by cause and operator. Rows in
    the order of `summaries` (the ladder's)."""
    splits = {k: splits[k] for k in summaries if k in splits}
    if not splits:
        return
    print("time split of the full step (torch.profiler shares x the median full step, "
          "ms per step; in brackets the part's own limit):\n")
    print("| setting | step | GEMM + attention + FFT | elementwise+norm | optimizer | loader "
          "| Python+framework | dtype casts |")
    print("|---|" + "---:|" * 7)
    for label, split in splits.items():
        step, shares, lim = summaries[label].step_s, split.shares, limits.get(label)
        kernels = step * sum(shares[k] for k in ("GEMM", "attention", "FFT"))
        elementwise = step * shares["elementwise+norm"]
        casts = step * split.causes["casts"] / split.total
        cells = [_ms(step),
                 _ms(kernels) + (f" ({_ms(sum(lim.ceiling.values()))})" if lim else ""),
                 _ms(elementwise) + (f" ({_ms(lim.elementwise)})" if lim else ""),
                 _ms(step * shares["optimizer"]) + (f" ({_ms(lim.optimizer)})" if lim else ""),
                 _ms(step * shares["loader"]), _ms(step * shares["Python+framework"]),
                 f"{100 * casts / step:.1f} % ({split.cast_calls:.0f} calls)"]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("\nelementwise+norm by cause (ms per step; bench/time_split.py), and its costliest "
          "operators:\n")
    base = next(iter(splits))
    print("| setting | " + " | ".join(CAUSES) + f" | per sample, vs {base} |")
    print("|---|" + "---:|" * (len(CAUSES) + 1))
    per_sample = {k: summaries[k].step_s * splits[k].shares["elementwise+norm"]
                  / summaries[k].batch for k in splits}
    for label, split in splits.items():
        scale = summaries[label].step_s / split.total
        cells = " | ".join(_ms(scale * split.causes[c]) for c in CAUSES)
        print(f"| {label} | {cells} | {per_sample[label] / per_sample[base]:.2f}x |")
    for label, split in splits.items():
        scale = summaries[label].step_s / split.total
        ops = ", ".join(f"{name} {_ms(scale * t)}" for name, t in split.top_ops(6))
        print(f"  {label}: {ops}")
