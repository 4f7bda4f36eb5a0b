"""bench.bench_spatial runs end to end on tiny_afno (no timing assertions): the all-to-all
bytes it counts in the run equal `distributed.fft.alltoall_bytes`, and every mesh computes
the same first loss. Its per-rank formula (the comparison with tensor parallelism in
docs/spatial_parallelism.md) is the exact count divided by the ranks when the splits are
even."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO, child_env

from bench.bench_spatial import RESULT_TAG, spatial_bytes, tensor_parallel_bytes
from distributed.fft import alltoall_bytes, kept_modes


@pytest.mark.parametrize("mesh", [(2, 2), (4, 1), (1, 4), (4, 4)])
def test_the_per_rank_formula_is_the_exact_count_shared_by_the_ranks(mesh):
    grid, dim, depth, batch = (8, 16), 256, 6, 16  # cpu_afno
    acts, grads = spatial_bytes(batch, grid, dim, depth, shared=1000, mesh=mesh)
    exact = 2 * depth * alltoall_bytes(batch, kept_modes(grid), dim, mesh)
    assert acts * mesh[0] * mesh[1] == pytest.approx(exact, rel=1e-12)
    h, w = mesh
    assert grads == 4 * 1000 * 2 * ((h - 1) / h + (w - 1) / w)
    # tensor parallelism all-reduces the whole activation: 4 per block, 2 (t-1)/t each
    assert tensor_parallel_bytes(batch, grid, dim, depth, 4) == depth * 4 * 1.5 * 4 * batch \
        * 128 * dim


@pytest.mark.e2e
@pytest.mark.distributed
def test_bench_spatial_counts_the_all_to_all_bytes_of_the_formula(tiny_data) -> None:
    cmd = [sys.executable, "-m", "bench.bench_spatial", "--config", "tiny_afno", "--mesh",
           "1x1", "2x2", "--iters", "1", "--warmup", "0"]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env({"DATA_DIR": str(tiny_data)}),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 1x1 ")
            or line.startswith("| 2x2 ")]
    assert len(rows) == 2, proc.stdout
    serial, mesh = (r.split("|") for r in rows)
    assert serial[-2] == mesh[-2]  # loss step 1
    assert "0.00 / 0.00 (equal)" in serial[9] and "(equal)" in mesh[9], rows
    assert float(mesh[9].split("/")[0]) > 0


@pytest.mark.e2e
def test_a_vit_config_is_refused_with_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.bench_spatial", "--config", "tiny"],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "spatial parallelism is the AFNO's" in proc.stderr
    assert RESULT_TAG not in proc.stdout  # nothing was launched
