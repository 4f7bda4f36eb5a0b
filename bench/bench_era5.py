"""The preparation of real ERA5, timed on a replica of WeatherBench-2's 5.625-degree store.

    python -m bench.bench_era5 [--dir DIR] [--workers 2] [--batch_size 32] [--days N]

1. Builds (once, under --dir) the replica of bench/era5_replica.py: the public store's
   65-year time axis with data in 2016-2018, and a 2-year store (2016-2017) of the same
   layout.
2. Runs the command a user runs, `python -m era5.prepare REPLICA OUT --train_years 2016
   --valid_years 2017 --test_years 2018 --workers W --batch_size B`, and reports its wall
   time, its CPU time (user + system, the process and its workers: what the wall time
   would be on one idle core) and the peak memory of the whole command (the sum of the
   resident memory of the process and its children, sampled every 50 ms).
3. Opens both stores in this process and times `Source.read` of the same batches from each
   (interleaved): the time per batch should not depend on the length of the time axis.

Numbers, the machine and the load go to docs/real_era5.md ("Reading cost"). `--days N`
writes and prepares only the first N days of each year (a quick check that it runs).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from bench.era5_replica import build
from utils.hardware import cpu_name

YEARS = ["--train_years", "2016", "--valid_years", "2017", "--test_years", "2018"]


def stores(where: Path, days: int | None) -> tuple[Path, Path]:
    """(the 65-year replica, the 2-year store), built if missing."""
    tag = "" if days is None else f"_{days}d"
    long = where / f"wb2_64x32_1959-2023{tag}.zarr"
    short = where / f"wb2_64x32_2016-2017{tag}.zarr"
    for path, args in ((long, ([2016, 2017, 2018],)),
                       (short, ([2016, 2017], "2016-01-01T00", "2018-01-01T00"))):
        if not (path / ".zmetadata").exists():
            start = time.perf_counter()
            build(path, *args, days=days)
            print(f"built {path} in {time.perf_counter() - start:.0f} s", flush=True)
    return long, short


def run_command(store: Path, out: Path, workers: int, batch: int, days: int | None
                ) -> tuple[float, float, float, str]:
    """(wall seconds, CPU seconds, peak MB of the process tree, the command's last line)."""
    cmd = [sys.executable, "-m", "era5.prepare", str(store), str(out), *YEARS,
           "--workers", str(workers), "--batch_size", str(batch)]
    cmd += [] if days is None else ["--max_samples", str(4 * days)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out_text = proc.stdout.read() if proc.stdout else ""
    if proc.returncode:
        raise SystemExit(f"error: the preparation failed (exit {proc.returncode})")
    return seconds, cpu, peak / 1e6, out_text.strip().splitlines()[-1]


def per_batch(long: Path, short: Path, batch: int, batches: int) -> dict[str, list[float]]:
    """Seconds to open each store (and find 2016's times in it), then per batch of `batch`
    2016 samples, the two stores interleaved."""
    from era5.source import Source

    first, end = np.datetime64("2016-01-01T00", "h"), np.datetime64("2017-01-01T00", "h")
    times: dict[str, list[float]] = {"open 65 years": [], "open 2 years": [],
                                     "batch 65 years": [], "batch 2 years": [],
                                     "batch 65 years, CPU": [], "batch 2 years, CPU": []}
    sources = {}
    for attempt in range(4):  # the first round imports the libraries: not timed
        for label, path in (("65 years", long), ("2 years", short)):
            start = time.perf_counter()
            sources[label] = Source(str(path), first, end)
            sources[label].select_year(2016)
            if attempt:
                times[f"open {label}"].append(time.perf_counter() - start)
    for source in sources.values():
        source.read(0, batch)  # warm: the thread pool, the first chunks
    for k in range(1, batches + 1):
        for label, source in sources.items():
            start, cpu = time.perf_counter(), time.process_time()  # all threads' CPU
            source.read(k * batch, (k + 1) * batch)
            times[f"batch {label}"].append(time.perf_counter() - start)
            times[f"batch {label}, CPU"].append(time.process_time() - cpu)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "bench_era5"),
                   help="where the replicas are built (kept for the next run)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--batches", type=int, default=20, help="batches timed per store")
    p.add_argument("--days", type=int, default=None,
                   help="only the first N days of each year (default: whole years)")
    args = p.parse_args()
    where = Path(args.dir)
    where.mkdir(parents=True, exist_ok=True)
    long, short = stores(where, args.days)
    print(f"CPU {cpu_name()}; load average "
          f"{os.getloadavg()[0]:.1f} before", flush=True)
    with tempfile.TemporaryDirectory(dir=where) as out:
        seconds, cpu, peak, last = run_command(long, Path(out), args.workers,
                                               args.batch_size, args.days)
    samples = 4384 if args.days is None else 3 * 4 * args.days
    print(f"prepare_era5 (3 years, {samples} samples, --workers {args.workers} --batch_size "
          f"{args.batch_size}): {seconds:.1f} s wall, {cpu:.1f} s CPU, peak memory of the "
          f"command {peak:.0f} MB (load average {os.getloadavg()[0]:.1f} after)\n  {last}",
          flush=True)
    times = per_batch(long, short, args.batch_size, args.batches)
    for key, values in times.items():
        print(f"{key:>20}: {1e3 * float(np.median(values)):8.1f} ms (median of "
              f"{len(values)}; min {1e3 * min(values):.1f}, max {1e3 * max(values):.1f})")
    for what in ("", ", CPU"):
        ratio = (np.median(times[f"batch 65 years{what}"])
                 / np.median(times[f"batch 2 years{what}"]))
        print(f"time per batch{what}, 65-year store / 2-year store: {ratio:.2f}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
