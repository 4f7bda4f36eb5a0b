"""utils/allocator.py: after keep_freed_memory(), memory a step frees is reused without
new page faults; any MALLOC_* variable leaves glibc's settings alone. Each case runs in a
fresh interpreter (malloc settings are process-wide)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO, child_env

PROBE = """
import resource, sys
import torch
from utils.allocator import keep_freed_memory
kept = keep_freed_memory()
def step():  # a step's worth of short-lived activations, 1-16 MiB each
    xs = [torch.ones(n << 18) for n in (1, 2, 4, 8, 16, 8, 4)]
    return sum(float(x[0]) for x in xs)
faults = []
for _ in range(15):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(kept, sorted(faults[3:])[6])  # the median step after three to fill the heap
"""


def probe(env: dict[str, str] | None = None) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=child_env(env),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    kept, faults = out.stdout.split()
    return kept == "True", int(faults)


@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_freed_memory_is_reused_without_page_faults():
    kept, faults = probe()
    assert kept
    # without the setting a step faults in ~11,000 fresh pages; reused memory, a few dozen
    assert faults < 1000, f"{faults} page faults in the median step (it allocates ~11,000 pages)"


@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_a_malloc_environment_variable_wins():
    kept, _ = probe({"MALLOC_CHECK_": "0"})
    assert not kept
