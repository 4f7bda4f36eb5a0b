"""The GPUs and networks the time model knows: peak rates, as their makers publish them.

GPUs (dense math, no sparsity; NVIDIA's data sheets, SXM parts): FLOP/s per matmul input
dtype, HBM bandwidth, memory as sold. fp32 matmuls run as TF32 on these GPUs: the train
scripts allow TF32 unless NVIDIA_TF32_OVERRIDE=0 (distributed/comm.py).

Networks (per GPU, each way):
  perlmutter  4 A100 per node, every pair joined by 4 NVLink-3 links (100 GB/s per pair;
              3 peers: 300 GB/s), one Slingshot-11 NIC of 25 GB/s per GPU
  ib-hgx      8 H100/H200 per node on NVSwitch (NVLink 4: 450 GB/s per GPU), one
              400 Gb/s InfiniBand NIC (50 GB/s) per GPU
On a node whose GPUs are joined pair by pair (`switched` False), a group of m ranks of a
node reaches m - 1 peers; through a switch every GPU has its full bandwidth to any peer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from utils.errors import UserError

GB = 1e9
TERA = 1e12


@dataclass(frozen=True)
class Gpu:
    name: str
    flops: dict[torch.dtype, float]  # peak dense FLOP/s by matmul input dtype
    hbm: float  # bytes/s
    memory_gb: float  # as sold (the planner's `gpu_memory_gb`)

    def peak(self, dtype: torch.dtype | None) -> float:
        """FLOP/s of a matmul whose inputs are `dtype` (complex and others: as fp32)."""
        return self.flops.get(dtype, self.flops[torch.float32])


def _rates(tf32: float, half: float) -> dict[torch.dtype, float]:
    """FLOP/s by matmul input dtype: fp32 runs as TF32 (module docstring)."""
    return {torch.float32: tf32 * TERA, torch.float16: half * TERA,
            torch.bfloat16: half * TERA}


GPUS: dict[str, Gpu] = {
    "a100-40gb": Gpu("a100-40gb", _rates(156, 312), 1.55e12, 40),
    "a100-80gb": Gpu("a100-80gb", _rates(156, 312), 2.0e12, 80),
    "h100": Gpu("h100", _rates(494.5, 989), 3.35e12, 80),
    "h200": Gpu("h200", _rates(494.5, 989), 4.8e12, 141),
}


@dataclass(frozen=True)
class Network:
    name: str
    gpus_per_node: int
    nvlink: float  # bytes/s each way: to one peer (pair links) or to any (a switch)
    switched: bool  # NVSwitch (True) or a link per pair of GPUs (False)
    nic: float  # bytes/s each way, per GPU (one NIC each)
    hop_latency_intra: float = 1e-6  # s per step of a ring or tree inside a node (assumed)
    hop_latency_inter: float = 5e-6  # s per step that crosses nodes (assumed)

    def intra_bandwidth(self, ranks_here: int) -> float:
        """Bytes/s each way one rank reaches its group's ranks on its node with."""
        return self.nvlink if self.switched else self.nvlink * max(ranks_here - 1, 1)


NETWORKS: dict[str, Network] = {
    "perlmutter": Network("perlmutter", 4, 100 * GB, False, 25 * GB),
    "ib-hgx": Network("ib-hgx", 8, 450 * GB, True, 50 * GB),
}
DEFAULT_NETWORK = {"a100-40gb": "perlmutter", "a100-80gb": "perlmutter", "h100": "ib-hgx",
                   "h200": "ib-hgx"}


def gpu_named(name: str) -> Gpu:
    if name not in GPUS:
        raise UserError(f"unknown --gpu {name!r}: the time model knows {', '.join(GPUS)}")
    return GPUS[name]


def network_named(name: str) -> Network:
    if name not in NETWORKS:
        raise UserError(f"unknown --network {name!r}: the presets are {', '.join(NETWORKS)}")
    return NETWORKS[name]
