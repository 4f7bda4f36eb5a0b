"""The real stores at full size: peak memory of the 0.25-degree commands, measured.

    python -m bench.bench_era5_full [--dir DIR] [--only prepare|inference] [--samples N]

On replicas with the public stores' 0.25-degree layout and chunking (bench/era5_replica.py:
the data only where the measurement reads, every other chunk a finite fill value), it runs
the commands a user runs and reports each one's peak memory: the sum of the resident memory
of the command and its children, sampled every 0.2 s (psutil), and its wall and CPU time:

  1. preparing a training year from WeatherBench-2's 0.25-degree store, as the tutorial's
     full-size command does (`--crop_rows 720 --coarsen 2`) and at 0.25 degrees
     (`--crop_rows 720`), `--workers auto`, the first `--samples` 6-hourly samples of 2018
     (the batches repeat after the first: the peak of a whole year is reached early, and
     the time line of the memory shows it), then the statistics;
  2. `inference.py --climatology` with its defaults (32 initial conditions, 20 leads, the
     batch size chosen for the grid) on a 720 x 1440 test year, against WeatherBench-2's
     0.25-degree climatology store (chunks of 3 hours x 3 days x one level), with a small
     ViT (patch 16, 2 blocks of width 32) trained for one step by train.py: the model's own
     memory is a few MB, so the peak is the evaluation's.

Numbers, the machine and its load go to docs/real_era5.md ("0.25 degrees, measured").
Disk: ~6 GB of replicas, ~6 GB written by the preparation (deleted after), 2 GB of test data.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from bench.era5_replica import build_climatology_quarter, build_quarter
from utils.hardware import cpu_name

REPO = Path(__file__).resolve().parent.parent
H, W = 720, 1440


def measure(cmd: list[str], env: dict[str, str] | None = None, cwd: Path = REPO
            ) -> dict[str, object]:
    """Run `cmd`; its wall time, CPU time (the process and its children), the peak of the
    summed resident memory of its process tree, the time line of that memory (s, bytes)
    and its output."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                text=True)
        root, peak, line, cpu = psutil.Process(proc.pid), 0, [], {}
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
                rss = 0
                for p in tree:
                    with p.oneshot():
                        rss += p.memory_info().rss
                        t = p.cpu_times()
                        cpu[p.pid] = t.user + t.system
                peak = max(peak, rss)
                line.append((time.perf_counter() - start, rss))
            except psutil.Error:
                pass
            time.sleep(0.2)
        log.seek(0)
        output = log.read()
    if proc.returncode:
        raise SystemExit(f"error: {' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n"
                         + output[-3000:])
    return {"wall": time.perf_counter() - start, "cpu": sum(cpu.values()), "peak": peak,
            "timeline": line, "output": output}


def describe(name: str, run: dict[str, object]) -> str:
    line = run["timeline"]
    half = len(line) // 2  # type: ignore[arg-type]
    first = max((b for _, b in line[:half]), default=0)  # type: ignore[index]
    second = max((b for _, b in line[half:]), default=0)  # type: ignore[index]
    return (f"{name}: peak {run['peak'] / 2**30:.2f} GiB ({run['peak'] / 1e9:.2f} GB; first "
            f"half of the run {first / 2**30:.2f} GiB, second half {second / 2**30:.2f} GiB), "
            f"{run['wall']:.0f} s wall, {run['cpu']:.0f} s CPU")


# ------------------------------------------------------------------ the test data
def prepared_replica(where: Path) -> Path:
    """A data directory as the preparation writes it at 720 x 1440, its samples unwritten
    (HDF5 reads them as the fill value 1.0; means 0 and stds 1): a
    training, a validation and a test year of 1460 samples, stats/ with a climatology."""
    import h5py

    from data.climatology import TERMS, save_climatology
    from data.era5_names import CHANNEL_NAMES
    from data.grid import Grid, save_stats_grid, write_file_grid

    if (where / "stats" / "climatology.npz").exists():
        return where
    grid = Grid(90.0 - 0.25 * np.arange(H), 0.25 * np.arange(W))
    C = len(CHANNEL_NAMES)
    for split, year in (("train", 2017), ("valid", 2016), ("test", 2018)):
        (where / split).mkdir(parents=True, exist_ok=True)
        hours = (np.arange(np.datetime64(f"{year}-01-01T00", "h"),
                           np.datetime64(f"{year + 1}-01-01T00", "h"), np.timedelta64(6, "h"))
                 - np.datetime64("1970-01-01T00", "h")).astype(np.int64)
        with h5py.File(where / split / f"{year}.h5", "w") as f:
            fields = f.create_dataset("fields", (len(hours), C, H, W), dtype="f4",
                                      chunks=(1, C, H, W), fillvalue=1.0)
            fields.attrs.update({"channel_names": list(CHANNEL_NAMES),
                                 "samples_per_year": len(hours), "rh_definition": "wb2"})
            f.create_dataset("time", data=hours)
            write_file_grid(f, grid)
    stats = where / "stats"
    stats.mkdir(exist_ok=True)
    for name, value in (("global_means", 0.0), ("global_stds", 1.0)):
        np.save(stats / f"{name}.npy", np.full((1, C, 1, 1), value, np.float32))
    np.save(stats / "time_means.npy", np.ones((1, C, H, W), np.float32))
    save_climatology(stats, np.zeros((len(TERMS), C + 1, H, W), np.float32),
                     np.ones((C + 1, H, W), np.float32), (*CHANNEL_NAMES, "ws10"), 1460, "wb2")
    save_stats_grid(stats, grid)
    return where


CONFIG = """
era5_quarter:
  <<: *tiny
  img_size: [720, 1440]
  patch_size: 16
  num_iters: 1
  global_batch_size: 2
  limit_nsamples: 4
  limit_nsamples_val: 2
"""


def trained(where: Path, data: Path) -> tuple[Path, dict[str, str]]:
    """(the YAML config, the environment) of a one-step train.py run at 720 x 1440."""
    yaml = where / "config.yaml"
    yaml.write_text((REPO / "config" / "ViT.yaml").read_text() + CONFIG)
    env = {**os.environ, "DATA_DIR": str(data), "LOG_DIR": str(where / "logs"),
           "PYTHONPATH": str(REPO)}
    if not list((where / "logs").glob("era5_quarter/*/*/checkpoints/*.pt")):
        run = measure([sys.executable, "train.py", f"--yaml_config={yaml}",
                       "--config=era5_quarter"], env)
        print(describe("train.py, one step at 720 x 1440", run), flush=True)
    return yaml, env


# ------------------------------------------------------------------ the commands
def prepare(store: Path, out: Path, samples: int, *flags: str) -> dict[str, object]:
    cmd = [sys.executable, "-m", "era5.prepare", str(store), str(out), "--train_years",
           "2018", "--max_samples", str(samples), "--workers", "auto", *flags]
    try:
        return measure(cmd)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "bench_era5_full"))
    p.add_argument("--only", choices=("prepare", "inference"), default=None)
    p.add_argument("--samples", type=int, default=64,
                   help="6-hourly samples of the year prepared (8 batches of 8)")
    args = p.parse_args()
    where = Path(args.dir)
    where.mkdir(parents=True, exist_ok=True)
    memory = psutil.virtual_memory()
    print(f"CPU {cpu_name()}; {os.cpu_count()} cores; load average "
          f"{os.getloadavg()[0]:.1f}; memory {memory.total / 2**30:.0f} GiB, "
          f"{memory.available / 2**30:.1f} GiB available", flush=True)
    if args.only in (None, "prepare"):
        store = where / "wb2_1440x721.zarr"
        if not (store / ".zmetadata").exists():
            start = time.perf_counter()
            build_quarter(store, [2018], written=16)
            print(f"built {store} in {time.perf_counter() - start:.0f} s", flush=True)
        for label, flags in (("--crop_rows 720 --coarsen 2 (360 x 720)",
                              ("--crop_rows", "720", "--coarsen", "2")),
                             ("--crop_rows 720 (720 x 1440)", ("--crop_rows", "720"))):
            run = prepare(store, where / "prepared", args.samples, *flags)
            chosen = [x for x in str(run["output"]).splitlines() if "--workers auto" in x]
            print(describe(f"prepare_era5, one training year, {label}", run)
                  + (f"\n  {chosen[0]}" if chosen else ""), flush=True)
    if args.only in (None, "inference"):
        clim = where / "clim_1440x721.zarr"
        if not (clim / ".zmetadata").exists():
            start = time.perf_counter()
            build_climatology_quarter(clim)
            print(f"built {clim} in {time.perf_counter() - start:.0f} s", flush=True)
        data = prepared_replica(where / "data")
        yaml, env = trained(where, data)
        run = measure([sys.executable, "inference.py", f"--yaml_config={yaml}",
                       "--config=era5_quarter", f"--climatology={clim}",
                       f"--out={where / 'forecast'}"], env)
        said = [x for x in str(run["output"]).splitlines() if "at a time" in x
                or "Rolled out" in x]
        print(describe("inference.py --climatology, defaults, 720 x 1440", run)
              + "".join(f"\n  {x.strip()}" for x in said), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
