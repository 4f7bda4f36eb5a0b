"""Data loader throughput alone (no model): the PyTorch loader vs the DALI loader.

    DATA_DIR=datasets/synthetic python -m bench.bench_loader --config cpu_short
    python -m bench.bench_loader --workers 0 2 --epochs 4 --step_samples_per_sec 40

For each loader and worker count it reads whole training epochs, as train.py does (set_epoch,
then `for inp, tar in loader`), and prints the time to the first batch (worker start-up), the
samples per second of the later epochs, and the CPU time the training process itself spends
per batch (what the loader takes from the step when there are no spare cores; worker
processes are not counted). `pytorch+thread` is the PyTorch loader with `prefetch_thread`.
With --step_samples_per_sec (the training rate, e.g. from bench.bench_step or a run's
"avg ... samples/sec") it also prints how many times faster than the training step each
loader is: below 1x the loader is the bottleneck.
"""

from __future__ import annotations

import argparse
import statistics
import time

from data.loader import get_loader
from utils.config import DEFAULT_YAML, read_config
from utils.config_schema import Config

LOADERS = ("pytorch", "pytorch+thread", "dali")


def time_loader(cfg: Config, batch_size: int, kind: str, workers: int, epochs: int
                ) -> dict[str, float]:
    """Seconds to the first batch; median and best samples/s of epochs 2.. (epoch 1 includes
    the start-up). Best-of is the rate on a quiet machine; the median shows the noise."""
    cfg = cfg.replace(num_data_workers=workers,
                      data_loader_config="dali" if kind == "dali" else "pytorch",
                      prefetch_thread=kind == "pytorch+thread")
    start = time.perf_counter()
    loader, _, sampler = get_loader(cfg, cfg.train_data_path, train=True,
                                    batch_size=batch_size)
    first_batch, rates, cpu = None, [], []
    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch)
        t0, c0, n = time.perf_counter(), time.process_time(), 0
        for inp, _ in loader:
            n += inp.shape[0]
            if first_batch is None:
                first_batch = time.perf_counter() - start
        rates.append(n / (time.perf_counter() - t0))
        cpu.append((time.process_time() - c0) / max(len(loader), 1))
    if kind == "dali":
        loader.close()
    steady = rates[1:] or rates
    return {"first_batch_s": first_batch or 0.0, "median": statistics.median(steady),
            "best": max(steady), "batches": len(loader),
            "cpu_ms": 1e3 * statistics.median(cpu[1:] or cpu)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--yaml_config", default=DEFAULT_YAML)
    p.add_argument("--config", default="cpu_short")
    p.add_argument("--local_batch_size", type=int, default=16)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2],
                   help="num_data_workers values to measure")
    p.add_argument("--loaders", nargs="+", choices=LOADERS, default=list(LOADERS))
    p.add_argument("--epochs", type=int, default=6, help="epochs per measurement (>= 2)")
    p.add_argument("--step_samples_per_sec", type=float, default=None,
                   help="training step rate to compare the loaders with")
    args = p.parse_args(argv)

    cfg = read_config(args.yaml_config, args.config)
    H, W = cfg.img_size
    print(f"config {args.config}: {cfg.train_data_path}, {H}x{W}, "
          f"local batch {args.local_batch_size}, limit_nsamples {cfg.limit_nsamples}")
    header = (f"{'loader':<14} {'workers':>7} {'batches':>7} {'first batch s':>13} "
              f"{'samples/s median':>16} {'best':>7} {'own CPU ms/batch':>16}")
    if args.step_samples_per_sec:
        header += f" {'x step rate':>11}"
    print(header)
    for kind in args.loaders:
        for workers in args.workers:
            r = time_loader(cfg, args.local_batch_size, kind, workers, args.epochs)
            line = (f"{kind:<14} {workers:>7} {r['batches']:>7} {r['first_batch_s']:>13.2f} "
                    f"{r['median']:>16.1f} {r['best']:>7.1f} {r['cpu_ms']:>16.1f}")
            if args.step_samples_per_sec:
                line += f" {r['median'] / args.step_samples_per_sec:>10.1f}x"
            print(line, flush=True)
    if args.step_samples_per_sec:
        print(f"training step consumes {args.step_samples_per_sec:.1f} samples/s")
    else:
        print("(pass --step_samples_per_sec X to compare with the training step's rate)")


if __name__ == "__main__":  # required: DALI's workers are spawned and re-import this module
    main()
