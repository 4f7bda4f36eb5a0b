"""Benchmarks: `python -m bench.bench_step` (training step), `python -m bench.bench_loader`."""
