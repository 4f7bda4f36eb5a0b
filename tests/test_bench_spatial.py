"""bench.bench_spatial runs end to end on tiny_afno (no timing assertions): the all-to-all
bytes it counts in the run equal `distributed.fft.alltoall_bytes`, and every mesh computes
the same first loss."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, child_env

from bench.bench_spatial import RESULT_TAG

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]


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


def test_a_vit_config_is_refused_with_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.bench_spatial", "--config", "tiny"],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "spatial parallelism is the AFNO's" in proc.stderr
    assert RESULT_TAG not in proc.stdout  # nothing was launched
