"""Prepare public ERA5 (a WeatherBench-2 / ARCO-ERA5 Zarr store, or CDS NetCDF files) in the
tutorial's HDF5 layout: the 20 channels, one file per year per split, stats/ and the grid.

    python -m era5.prepare SOURCE OUT --train_years 1979-2015 \\
        --valid_years 2016-2017 --test_years 2018 [--crop_rows 720] [--coarsen K] \\
        [--max_samples N] [--batch_size B] [--workers N|auto] [--read_threads T] \\
        [--rh_definition wb2|ecmwf] [--task I]

Writes OUT/{train,valid,test}/<year>.h5 (era5/writer.py) and, from the training
years, OUT/stats/: global_means.npy, global_stds.npy, time_means.npy (the tutorial's),
climatology.npz (seasonal and diurnal harmonics, data/climatology.py),
latitude.npy and longitude.npy. Years run in parallel (--workers processes, or one SLURM
array task per year with --task; `--workers auto`: as many as the memory available holds,
`memory_per_worker`); the statistics are merged exactly from each training year's partial
sums (data/statistics.py) by a run without --task once every year is written. A second
run skips every year already written and verified. Reading and naming:
era5/source.py; the whole story: docs/real_era5.md.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import queue as queues
import resource
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any, NoReturn

if __name__ == "__main__":
    # Before numpy is imported (here and in the workers, which inherit it): the statistics'
    # small matrix products take ~0.06 ms on one BLAS thread and ~0.5-4 ms on OpenBLAS's
    # threads, which also spin beside the read threads.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from data.humidity import DEFINITIONS
from data.statistics import PartialSums, write_stats
from era5.source import READ_THREADS
from era5.writer import (
    Plan,
    YearResult,
    file_grid,
    file_rh_definition,
    forget_sources,
    is_complete,
    memory_per_worker,
    open_source,
    output_grid,
    prepare_year,
    sums_file,
    year_file,
)
from utils.errors import EXIT_USER_ERROR, DataError

SPLITS = ("train", "valid", "test")
EPILOG = """\
memory (peak, per worker): the chunks a batch reads, decoded while it is read (a store
  chunk holds one time of a variable, all its levels): batch_size x ~295 MB at 0.25
  degrees from WeatherBench-2, x ~795 MB from ARCO-ERA5 (37 levels); the batch's fields
  as read and on the output grid; for a training year its statistics sums,
  14 x 21 x H x W x 8 bytes (H x W: the output grid: 2.4 GB at 0.25 degrees, 0.6 GB with
  --coarsen 2); ~0.3 GB of Python and libraries. --workers auto runs as many workers as
  the memory available holds by this estimate (the log says how many and why);
  docs/real_era5.md has the peaks measured.

SLURM: one array task per year (tasks count the train, then valid, then test years), then
  one run without --task to verify every year and merge the statistics:
  jid=$(sbatch --parsable --array=0-39 --wrap "python -m era5.prepare SRC OUT \\
      --train_years 1979-2015 --valid_years 2016-2017 --test_years 2018 \\
      --task \\$SLURM_ARRAY_TASK_ID")
  sbatch --dependency=afterok:$jid --wrap "python -m era5.prepare SRC OUT \\
      --train_years 1979-2015 --valid_years 2016-2017 --test_years 2018"
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, as every other user error
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def years(text: str) -> list[int]:
    """'1979-2015' -> [1979, ..., 2015]; '2018' -> [2018]."""
    try:
        first, _, last = text.partition("-")
        a, b = int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a year or a range A-B") from None
    if b < a or not 1900 <= a <= 2200:
        raise argparse.ArgumentTypeError(f"'{text}' is not a range of years A-B with A <= B")
    return list(range(a, b + 1))


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def workers(text: str) -> int | str:
    return "auto" if text == "auto" else positive(text)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m era5.prepare", description=__doc__.split("\n\n")[0],
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE",
                   help="a Zarr store (path or gs:// URL) or a directory of CDS NetCDF files")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.add_argument("--train_years", type=years, required=True, metavar="A-B",
                   help="years of the training split (the statistics come from them)")
    p.add_argument("--valid_years", type=years, default=[], metavar="A-B")
    p.add_argument("--test_years", type=years, default=[], metavar="A-B")
    p.add_argument("--crop_rows", type=positive, default=None, metavar="N",
                   help="keep the first N rows, north to south (the tutorial: 720 of 721)")
    p.add_argument("--coarsen", type=positive, default=1, metavar="K",
                   help="block means of K x K grid points (after the crop)")
    p.add_argument("--max_samples", type=positive, default=None, metavar="N",
                   help="only the first N 6-hourly samples of each year (a quick subset)")
    p.add_argument("--batch_size", type=positive, default=8, metavar="B",
                   help="samples read and written at a time (memory: see below)")
    p.add_argument("--workers", type=workers, default=1, metavar="N|auto",
                   help="years prepared in parallel processes; auto: as many as the cores "
                        "and the memory available hold (below)")
    p.add_argument("--read_threads", type=positive, default=READ_THREADS, metavar="T",
                   help="reads in flight per process (a remote store's latency hides "
                        f"behind the others; default {READ_THREADS})")
    p.add_argument("--rh_definition", choices=sorted(DEFINITIONS), default=None,
                   help="which relative humidity to write: WeatherBench-2's (wb2, over "
                        "water) or ECMWF's (ecmwf, mixed phase; the CDS r); default: the "
                        "source's own (the other is derived from specific humidity)")
    p.add_argument("--task", type=int, default=None, metavar="I",
                   help="prepare only the I-th year (SLURM array task; no statistics)")
    return p


def jobs_of(args: argparse.Namespace) -> list[tuple[str, int]]:
    """[(split, year)] in the order train, valid, test; a year in two splits is refused."""
    jobs: list[tuple[str, int]] = []
    seen: dict[int, str] = {}
    for split in SPLITS:
        for year in getattr(args, f"{split}_years"):
            if year in seen:
                raise DataError(f"year {year} is in both --{seen[year]}_years and "
                                f"--{split}_years")
            seen[year] = split
            jobs.append((split, year))
    return jobs


class _Lines:
    """A log file's view of tqdm: each redraw becomes a line of its own."""

    def __init__(self, stream: Any):
        self.stream = stream

    def write(self, text: str) -> None:
        if text.startswith("\r"):
            self.stream.write(text[1:].rstrip() + "\n")
        elif text.strip():
            self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(total: int, bytes_per_sample: int) -> Any:
    """tqdm over the samples to write, with the MB/s written; on a terminal it redraws in
    place, in a log file it prints a line every 10 s."""
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    bar = tqdm(total=total, desc="prepared", unit=" samples",
               file=sys.stderr if tty else _Lines(sys.stderr),
               mininterval=0.5 if tty else 10.0, dynamic_ncols=tty, ascii=not tty)
    bar.bytes_per_sample = bytes_per_sample
    return bar


def _advance(bar: Any, n: int) -> None:
    seconds = max(bar.format_dict["elapsed"], 1e-9)
    written = (bar.n + n) * bar.bytes_per_sample / 1e6
    bar.set_postfix_str(f"{written / seconds:.1f} MB/s written", refresh=False)
    bar.update(n)


def _bytes_per_sample(plan: Plan) -> int:
    H, W = output_grid(plan, open_source(plan).grid).shape
    return 20 * H * W * 4


_progress: Any = None  # a worker's queue to the progress bar (set by its initializer)


def _worker_started(progress: Any) -> None:
    global _progress
    _progress = progress


def _in_worker(plan: Plan, split: str, year: int) -> YearResult:
    return prepare_year(plan, split, year, report=_progress.put)


def available_memory() -> int:
    """Bytes this process may still use: the memory available, or less where a cgroup
    (a SLURM job, a container) limits it."""
    import psutil

    available = psutil.virtual_memory().available
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit.isdigit():
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(int(available), 0)


def auto_workers(plan: Plan, todo: list[tuple[str, int]]) -> int:
    """As many workers as there are years to prepare, cores, and room in the memory
    available for the estimated peak of each (`memory_per_worker`), with a fifth of it
    kept free; at least one. Said on stderr."""
    per = memory_per_worker(plan, open_source(plan), any(s == "train" for s, _ in todo))
    available = available_memory()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    fits = math.floor(0.8 * available / per)
    n = max(1, min(len(todo), cores, fits))
    print(f"--workers auto: {n} ({len(todo)} year(s) to prepare, {cores} cores, "
          f"{available / 1e9:.1f} GB available, ~{per / 1e9:.1f} GB a worker at "
          f"--batch_size {plan.batch_size})"
          + ("; one worker may not fit: lower --batch_size" if fits < 1 else ""),
          file=sys.stderr)
    return n


def run(plan: Plan, jobs: list[tuple[str, int]], workers: int | str) -> list[YearResult]:
    """Prepare `jobs`, `workers` at a time (or "auto": `auto_workers`), with a progress bar
    over the samples to write."""
    todo = [(s, y) for s, y in jobs if not is_complete(plan, s, y)]
    for split, year in jobs:
        if (split, year) not in todo:
            print(f"{year_file(plan.out, split, year)} is complete, skipped", file=sys.stderr)
    if not todo:
        return []
    if workers == "auto":
        workers = auto_workers(plan, todo)
    with progress_bar(sum(plan.samples(y) for _, y in todo), _bytes_per_sample(plan)) as bar:
        if workers == 1 or len(todo) == 1:
            return [prepare_year(plan, s, y, report=lambda n: _advance(bar, n))
                    for s, y in todo]
        ctx = mp.get_context("spawn")  # fresh interpreters: no zarr or HDF5 state across fork
        progress = ctx.Queue()
        with ProcessPoolExecutor(min(workers, len(todo)), mp_context=ctx,
                                 initializer=_worker_started, initargs=(progress,)) as pool:
            pending: set[Future] = {pool.submit(_in_worker, plan, s, y) for s, y in todo}
            results = []
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                _drain(progress, bar)
                results += [f.result() for f in done]  # a worker's DataError is raised here
            _drain(progress, bar)
        return results


def _drain(progress: Any, bar: Any) -> None:
    while True:
        try:
            _advance(bar, progress.get_nowait())
        except queues.Empty:
            return


def merge_stats(plan: Plan, train_years: list[int]) -> None:
    """stats/ from every training year's sums (all must be there)."""
    sums = PartialSums.empty()
    for year in train_years:
        sums = sums.merge(PartialSums.load(sums_file(plan.out, year)))
    grid = file_grid(year_file(plan.out, "train", train_years[0]))
    definition = file_rh_definition(year_file(plan.out, "train", train_years[0]))
    for year in train_years[1:]:
        path = year_file(plan.out, "train", year)
        if not file_grid(path).same_as(grid):
            raise DataError(f"{plan.out}/train mixes grids: {year}.h5 and "
                            f"{train_years[0]}.h5 differ; prepare them again")
        if file_rh_definition(path) != definition:
            raise DataError(f"{plan.out}/train mixes relative humidity definitions: "
                            f"{year}.h5 holds '{file_rh_definition(path)}', "
                            f"{train_years[0]}.h5 '{definition}'; prepare them again")
    write_stats(os.path.join(plan.out, "stats"), sums, grid, definition)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    forget_sources()  # a preparation opens its source afresh
    jobs = jobs_of(args)
    span = (min(y for _, y in jobs), max(y for _, y in jobs))
    plan = Plan(os.path.abspath(args.source) if "://" not in args.source else args.source,
                args.out, args.crop_rows, args.coarsen, args.max_samples, args.batch_size,
                span, args.read_threads, args.rh_definition)
    if args.task is not None:
        if not 0 <= args.task < len(jobs):
            raise DataError(f"--task {args.task}: there are {len(jobs)} years (0 .. "
                            f"{len(jobs) - 1})")
        jobs = [jobs[args.task]]
    start = time.perf_counter()
    results = run(plan, jobs, args.workers)
    if args.task is None:
        merge_stats(plan, args.train_years)
    seconds = time.perf_counter() - start
    written = [r for r in results if not r.skipped]
    samples, size = sum(r.samples for r in written), sum(r.bytes for r in written)
    peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF,
                                                             resource.RUSAGE_CHILDREN))
    print(f"wrote {len(written)} year file(s), {samples} samples, {size / 1e6:.1f} MB in "
          f"{seconds:.1f} s ({samples / seconds:.1f} samples/s, {size / 1e6 / seconds:.1f} "
          f"MB/s); peak memory of a process {peak / 1024:.0f} MB"
          + ("" if args.task is not None else f"; statistics in {args.out}/stats"))


def cli(argv: list[str] | None = None) -> None:
    """The command line: a bad source, year or flag ends with one `error:` line, exit 2."""
    try:
        main(argv)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


if __name__ == "__main__":
    cli()
