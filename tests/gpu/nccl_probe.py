"""Two-node NCCL smoke test, one task per node (tests/gpu/test_gpu_parallel.py runs it with
srun; docs/gpu_self_test.md gives the sbatch line):

    srun -N 2 -n 2 --ntasks-per-node=1 [$SITE_LAUNCHER] bash -c \\
        'source export_DDP_vars.sh && exec python tests/gpu/nccl_probe.py'

Every task joins the job as the train scripts do (`distributed.comm.init_process`: the
rendezvous, the GPU of its local rank, NCCL with eager set-up), all-reduces 64 MiB across
the nodes, checks the sum, and names the network transport NCCL loaded. NCCL says that in
its INFO log: "NET/Plugin: Loaded net plugin AWS Libfabric (v6)", "Using network AWS
Libfabric", or "Using network Socket" when it found neither a plugin nor InfiniBand (plain
TCP: a fraction of the bandwidth). The probe sends NCCL's log to a file of its own
(NCCL_DEBUG_FILE) and reads it back, so the answer does not depend on who collects stdout.
Each rank prints a `nccl-probe rank=...` line; rank 0 ends with `nccl-probe ok: ...`.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NUMEL = 16 * 2**20  # 64 MiB of fp32
REPEATS = 5
# What NCCL's INFO log says about its network (the first match of each is reported).
NETWORK_LINES = {
    "network": re.compile(r"Using network (.+?)\s*$", re.M),
    "plugin": re.compile(r"Loaded net plugin (.+?)\s*$", re.M),
    "provider": re.compile(r"NET/OFI Selected [Pp]rovider is ([^\s,]+)", re.M),
}


def nccl_network(log: str) -> dict[str, str]:
    """{'network': 'AWS Libfabric', 'plugin': 'AWS Libfabric (v6)', 'provider': 'cxi'}:
    what NCCL's INFO log names ('?' where it says nothing)."""
    found = {}
    for key, pattern in NETWORK_LINES.items():
        m = pattern.search(log)
        found[key] = m.group(1) if m else "?"
    return found


def main() -> int:
    log_dir = tempfile.mkdtemp(prefix="nccl-probe-")
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET",
                      NCCL_DEBUG_FILE=f"{log_dir}/nccl.%h.%p")  # read when NCCL starts
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist

    from distributed import comm

    _, device = comm.init_process()
    if device.type != "cuda":
        print("nccl-probe: no CUDA device in this task", flush=True)
        return 2
    world, rank = comm.get_world_size(), comm.get_world_rank()
    x = torch.empty(NUMEL, device=device)
    seconds = []
    for _ in range(1 + REPEATS):  # the first one sets up the connections
        x.fill_(rank + 1.0)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(x)
        torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    exact = bool((x == world * (world + 1) / 2).all())
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    log = "".join(p.read_text(errors="replace") for p in Path(log_dir).glob("nccl.*"))
    net = nccl_network(log)
    bus = 2 * (world - 1) / world * NUMEL * 4 / min(seconds[1:]) / 1e9  # ring all-reduce
    print(f"nccl-probe rank={rank} host={socket.gethostname()} network={net['network']} "
          f"plugin={net['plugin']} provider={net['provider']} exact={exact}", flush=True)
    wrong = comm.any_rank(not exact, device)
    if rank == 0 and not wrong:
        print(f"nccl-probe ok: world {world} on {len(set(hosts))} nodes, all-reduce of 64 MiB "
              f"exact, {bus:.1f} GB/s bus bandwidth, network {net['network']} (plugin "
              f"{net['plugin']}, provider {net['provider']})", flush=True)
    comm.settle()
    comm.shutdown()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
