"""Run a function on N real processes (gloo on this host) from a pytest test.

`run_distributed(fn, world_size, *args)` starts `world_size` processes, initialises
torch.distributed in each (gloo, file-based rendezvous in a private temp dir: no ports to
collide), calls `fn(*args)` and returns the per-rank results. An exception on any rank fails
the test with that rank's traceback; a rank that hangs (e.g. a mismatched collective) is
killed after `timeout` seconds, so a broken test never hangs the suite.

Processes are forked where the platform allows it (Linux): the children inherit the already
imported torch, which makes starting 8 ranks take well under a second instead of many seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from utils import comm


def _worker(rank: int, world_size: int, store: str, timeout: float, fn: Callable[..., Any],
            args: tuple, results: Any) -> None:
    torch.set_num_threads(1)  # ranks share a couple of cores; also keeps forked OpenMP idle
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        comm.reset()
        out = fn(*args)
        results.put((rank, None, out))
    except BaseException:  # noqa: BLE001 - everything goes back to pytest
        results.put((rank, traceback.format_exc(), None))
    finally:
        comm.shutdown()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float = 60.0) -> list[Any]:
    """Run `fn(*args)` on `world_size` ranks; return the results ordered by rank."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, world_size, store, timeout, fn, args, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, timeout)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()


def _collect(procs: list, results: Any, timeout: float) -> list[Any]:
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(out) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(len(procs))) - set(out))
            _kill(procs)
            raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s")
        try:
            rank, error, value = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if r not in out and not p.is_alive() and p.exitcode not in (0, None)]
            if dead and results.empty():
                _kill(procs)
                code = procs[dead[0]].exitcode
                raise RuntimeError(f"rank {dead[0]} died (exit code {code})") from None
            continue
        if error is not None:
            _kill(procs)  # the other ranks may be blocked in a collective with the failed one
            raise AssertionError(f"rank {rank} failed:\n{error}")
        out[rank] = value
    return [out[r] for r in range(len(procs))]


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
