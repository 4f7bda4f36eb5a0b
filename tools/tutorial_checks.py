"""What the README says to look at after each command of its tutorial, as checks of the
command's output and files (tools/tutorial_walk.py runs the commands and applies them):
`looks(command)` lists the checks for one command, each `check(output, copy) -> (ok, text)`.

A training run's epoch lines (`make train` must end below persistence), the run directory a
README comment names, and LOOKS: a line or a file for each kind of command (the profiler's
trace, the precision line, the layout line, the ensemble's spread, inference.py's scores
and files, Earth2Studio's workflow, ...). A new README step that prints something to look
at gets its entry in LOOKS.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from tools.readme_commands import Command

RUN_DIR = re.compile(r"Run directory (\S+) \(")
EPOCH = re.compile(r"RMSE\(u10m\) model=([\d.]+) m/s, persistence=([\d.]+) m/s")

Check = Callable[[str, Path], tuple[bool, str]]


def verdict(ok: bool, what: str) -> tuple[bool, str]:
    return ok, f"{what}: {'yes' if ok else 'NO'}"


def line(pattern: str, what: str) -> Check:
    """The output has a line matching `pattern`."""
    def check(out: str, cwd: Path) -> tuple[bool, str]:
        return verdict(re.search(pattern, out) is not None, what)
    return check


def epoch_lines(must_beat: bool) -> Check:
    """The epoch lines' RMSE(u10m) against persistence, at the last epoch."""
    def check(out: str, cwd: Path) -> tuple[bool, str]:
        found = EPOCH.findall(out)
        if not found:
            return verdict(False, "epoch lines (RMSE(u10m) vs persistence)")
        model, persistence = map(float, found[-1])
        where = "below" if model < persistence else "above"
        text = f"RMSE(u10m) {model:.3f} m/s, {where} persistence's {persistence:.3f}"
        if must_beat:
            return verdict(model < persistence, f"{text}; below persistence")
        return True, text
    return check


def speed(out: str, cwd: Path) -> tuple[bool, str]:
    """The median epoch speed after the first epoch (start-up and warm-up), for reference."""
    rates = sorted(float(r) for r in re.findall(r"avg ([\d.]+) samples/sec", out)[1:])
    return True, f"median {rates[len(rates) // 2]:.1f} samples/s" if rates else "no epoch speed"


def file_logged(pattern: str, what: str) -> Check:
    """The output names a file (the first group of `pattern`) that exists."""
    def check(out: str, cwd: Path) -> tuple[bool, str]:
        m = re.search(pattern, out)
        return verdict(bool(m and (cwd / m.group(1)).exists()), what)
    return check


def exists(path: str, what: str) -> Check:
    """The file `path` exists in the copy after the command (made now or before)."""
    def check(out: str, cwd: Path) -> tuple[bool, str]:
        return verdict((cwd / path).exists(), f"{what} ({path})")
    return check


def forecast_files(out: str, cwd: Path) -> tuple[bool, str]:
    m = re.search(r"and tensorboard/ to (\S+)", out)
    names = ("skill_vs_lead.png", "skill.csv")
    ok = bool(m) and all((cwd / m.group(1) / n).exists() for n in names)
    return verdict(ok, "<run dir>/forecast/ skill_vs_lead.png, skill.csv")


def ensemble_files(out: str, cwd: Path) -> tuple[bool, str]:
    m = re.search(r"Wrote ensemble_skill.csv, .* to (\S+)", out)
    names = ("crps_vs_lead.png", "ensemble_skill.csv", "rank_histograms.png")
    ok = bool(m) and all((cwd / m.group(1) / n).exists() for n in names)
    return verdict(ok, "<run dir>/forecast/ crps_vs_lead.png, ensemble_skill.csv, "
                       "rank_histograms.png")


def run_dir_named(name: str) -> Check:
    """The run's directory is the one the README's comment names."""
    def check(out: str, cwd: Path) -> tuple[bool, str]:
        m = RUN_DIR.search(out)
        ok = bool(m) and (m.group(1) == name or m.group(1).endswith("/" + name))
        return verdict(ok, f"run directory {name}")
    return check


def trains(t: str) -> bool:
    return bool(re.search(r"\btrain(_mp|_mp_graphs)?\.py\b", t)) or t == "make train"


# (does it apply to this command?, the check), in the order the table shows them.
LOOKS: list[tuple[Callable[[str], bool], Check]] = [
    (trains, line(r"Finished \d+ iterations", "Finished N iterations")),
    (trains, speed),
    (lambda t: "ENABLE_PROFILING=1" in t,
     file_logged(r"torch.profiler trace written to (\S+) ", "trace file")),
    (lambda t: "ENABLE_PROFILING=1" in t,
     line(r"Time per range and top operators", "range and operator tables")),
    (lambda t: "--num_data_workers" in t or "dali" in t,
     line(r"avg [\d.]+ samples/sec", "Avg samples per sec")),
    (lambda t: "--amp_mode" in t, line(r"Precision: ", "the precision line")),
    (lambda t: "--enable_jit" in t,
     line(r"First step done [\d.]+ s after the process started; torch.compile [\d.]+ s",
          "First step done ...; torch.compile ... s")),
    (lambda t: "bench.bench_loader" in t,
     line(r"pytorch\s+2\s+\d+\s+[\d.]+\s+[\d.]+", "loader samples/s, 2 workers")),
    (lambda t: "bench.bench_step" in t and "--table" in t,
     line(r"\| setting \| precision \| samples/s", "the ladder table")),
    (lambda t: "bench.bench_step" in t and "--amp_modes" in t,
     line(r"against 'amp_mode none': [\d.]+x the samples/s", "bf16 against fp32, side by side")),
    (lambda t: re.search(r"(torchrun|mpirun) .*\btrain\.py .*cpu_bs32_opt", t) is not None,
     line(r"world size 2 \(\w+ launcher\), global batch 32, local batch 16",
          "global and local batch")),
    (lambda t: "train_mp" in t, line(r"Layout: DP = \d+, TP = \d+, CP = \d+", "Layout line")),
    (lambda t: "train_mp.py" in t and "--tp 2" in t,
     line(r"Parameters on this rank", "parameters per rank")),
    (lambda t: "train_mp_graphs.py" in t,
     line(r"CUDA graphs need a GPU", "the line saying it runs eagerly")),
    (lambda t: "bench.bench_mp" in t or "bench.bench_spatial" in t,
     line(r"\| peak RSS/rank \(GB\) \|", "memory per rank table")),
    (lambda t: t.startswith("make data-ens"),
     exists("datasets/synthetic_ens/stats/time_means.npy", "the forced planet's data set")),
    (lambda t: trains(t) and "--config=cpu_ens" in t,
     line(r"Ensemble of 4: spread\(u10m\)=[\d.]+ m/s; spread/skill [\d.]+ plain",
          "the ensemble's spread and spread/skill line")),
    (lambda t: "--ensemble_parallel_size 2" in t,
     line(r"Layout: DP = \d+, TP = 1, CP = 1, ENS = 2 ", "Layout line with ENS = 2")),
    (lambda t: "inference.py" in t and "--config=cpu_ens" in t,
     line(r"u10: ensemble CRPS below persistence's MAE at \d+ of \d+ leads; .*; [\d.]+ x the "
          r"perfect-model ensemble's", "the ensemble's CRPS against its references")),
    (lambda t: "inference.py" in t and "--config=cpu_ens" in t, ensemble_files),
    (lambda t: "tools.export_earth2studio" in t,
     line(r"Exported \S+ \(iteration \d+, \w+\) to \S+: 20 variables \(u10m, v10m,",
          "the package and its 20 Earth2Studio variables")),
    (lambda t: t.startswith("make venv-earth2studio"),
     exists(".venv-earth2studio/.installed", "Earth2Studio's environment")),
    (lambda t: "tools.earth2studio.forecast" in t,
     line(r"Earth2Studio's (deterministic|ensemble) workflow: ", "Earth2Studio's workflow ran")),
    (lambda t: "tools.earth2studio.forecast" in t,
     line(r"max \S+ over \d+ leads, 20 channels(, \d+ members)?: equal to 1e-05",
          "equal to inference.py's forecasts at every lead")),
    (lambda t: "inference.py" in t or t.startswith("make evaluate"), forecast_files),
    (lambda t: "inference.py" in t or t.startswith("make evaluate"),
     line(r": model RMSE above persistence .*; ACC below 0\.6 ", "where the skill runs out")),
]


def looks(c: Command) -> list[Check]:
    """What the README says to look at after `c`, as checks of its output and files: the
    epoch lines of a training run (`make train`'s must end below persistence), the run
    directory a comment names (the ladder), and the lines and files of LOOKS."""
    checks = [epoch_lines(must_beat=c.text == "make train")] if trains(c.text) else []
    words = c.comment.split()
    named = [w for w in words if re.fullmatch(r"logs/\S+/\d\d\S*", w)] or \
        [w for w in words if re.fullmatch(r"\d\d(-\S+)?", w)]
    checks += [run_dir_named(named[0])] if named else []
    return checks + [check for applies, check in LOOKS if applies(c.text)]
