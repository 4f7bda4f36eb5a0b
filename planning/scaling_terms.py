"""What a step loses beyond its compute and communication: the input pipeline, stragglers and
jitter, the epoch's validation; each stated, and weak scaling as a range, not one number.

    step = input_bound_step(compute_step_s, cfg, local_batch, rates)   # one GPU's loader
    high, low = weak_scaling_step(step, cfg, local_batch, gpus, gpus_per_node, dp)  # Terms

The input pipeline. A sample is what the loader reads of the tutorial's HDF5 fields: input
and target, (n_in + n_out x rollout) channels of H x W float32 (`sample_bytes`). A loader
process reads and normalises `rates.host_bytes_per_s`; the batch then crosses PCIe at
`rates.h2d_bytes_per_s`:
  - PyTorch loader, no workers: the step reads its batch, then computes: loader + copy +
    compute;
  - PyTorch loader, w workers: w batches are read at once, behind the compute; the copy
    runs on the compute's stream: max(compute, loader / w) + copy;
  - DALI (w threads): the reads behind the compute, the copy on DALI's own stream:
    max(compute, loader / w).
Across nodes each node reads m x b samples a step (m GPUs, b per GPU), at most what its
NICs carry (one per GPU) and its share of the file system: FS_BANDWIDTH (Perlmutter scratch,
"aggregate bandwidth of >5 TB/sec", NERSC's documentation) over the job's nodes, all of it
(high end: the job alone on the file system) or FS_SHARE_LOW of it (low end: a busy file
system; assumed). After the first epoch a node whose shard fits its memory reads from its
page cache: the low end is a first epoch's.

Stragglers and jitter. Each rank's step varies by a relative sigma (independent, normal); a
synchronous step waits for the slowest of N ranks: E[step] = step (1 + sigma z_N), z_N the
expected largest of N standard normals (Blom's approximation). SIGMA is a range: the SC25
16-GPU runs' epoch-to-epoch spreads (0.02-0.2 % over 592 steps) bound a per-step sigma of
independent steps at about 0.3-4 %; taken: 0.5 % (high end) to 3 % (low end).

The epoch. Each epoch validates V / dp samples per rank at VALIDATION_COST of a training
sample's time (the SC25 `short` logs: 1.37-1.50 s for 128 validation samples beside 9.4 s
for 512 training samples) and spends EPOCH_OVERHEAD_S (0 to 0.5 s: the loader's restart,
logging; assumed); spread over floor(T / global batch) steps. T and V: the config's sample
limits, else the tutorial's data set: TUTORIAL_TRAIN_SAMPLES (the SC25 `mp` epoch: 301.9 s at
125.5 samples/s) and TUTORIAL_VALID_SAMPLES (two years of 1,460, as docs/real_era5.md lays
them out; assumed).

The last gradient bucket's all-reduce, which no backward hides, is already in the step (the
time model's exposed dp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from planning.machines import GB
from planning.rates import MachineRates
from utils.config_schema import Config

FS_BANDWIDTH = 5e12
FS_SHARE_LOW = 0.25
NIC_PER_GPU = 25 * GB
SIGMA = (0.005, 0.03)
VALIDATION_COST = 0.6
EPOCH_OVERHEAD_S = (0.0, 0.5)
TUTORIAL_TRAIN_SAMPLES = 37_888
TUTORIAL_VALID_SAMPLES = 2 * 1460


def sample_bytes(cfg: Config) -> float:
    """Bytes the loader reads per sample: input and target fields, float32."""
    h, w = cfg.img_size
    return (cfg.n_in_channels + cfg.n_out_channels * cfg.rollout_steps) * h * w * 4


def loader_s(cfg: Config, local_batch: int, rates: MachineRates) -> float:
    """Seconds one loader process takes to read and normalise a batch."""
    return local_batch * sample_bytes(cfg) / rates.host_bytes_per_s


def input_bound_step(compute_step_s: float, cfg: Config, local_batch: int,
                     rates: MachineRates) -> float:
    """One GPU's step with its loader (module docstring)."""
    load = loader_s(cfg, local_batch, rates)
    copy = local_batch * sample_bytes(cfg) / rates.h2d_bytes_per_s
    workers = cfg.num_data_workers
    if cfg.data_loader_config == "dali":
        return max(compute_step_s, load / max(workers, 1))
    if workers == 0:
        return load + copy + compute_step_s
    return max(compute_step_s, load / workers) + copy


def expected_max_normal(n: int) -> float:
    """E[max of n standard normals] (Blom: the (n - 0.375) / (n + 0.25) quantile)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


@dataclass(frozen=True)
class Terms:
    """One end of the range: what each term adds to a step, in seconds."""

    step_s: float  # the time model's step (its exposed communication included)
    input_s: float  # the step's wait for the file system beyond it
    straggler_s: float
    epoch_s: float  # validation and the epoch's overhead, per step

    @property
    def total_s(self) -> float:
        return self.step_s + self.input_s + self.straggler_s + self.epoch_s


def epoch_counts(cfg: Config) -> tuple[int, int]:
    """(training, validation) samples of an epoch (module docstring)."""
    train = cfg.limit_nsamples or TUTORIAL_TRAIN_SAMPLES
    valid = cfg.limit_nsamples_val or TUTORIAL_VALID_SAMPLES
    return int(train), int(valid)


def weak_scaling_step(step_s: float, cfg: Config, local_batch: int, gpus: int,
                      gpus_per_node: int, dp: int) -> tuple[Terms, Terms]:
    """(high end, low end) of a step of `gpus` ranks, every term named (module docstring).
    `step_s`: the time model's step with its loader (`input_bound_step`)."""
    per_node = min(gpus, gpus_per_node)
    nodes = math.ceil(gpus / gpus_per_node)
    node_bytes = per_node * local_batch * sample_bytes(cfg)
    train, valid = epoch_counts(cfg)
    steps = max(train // (local_batch * dp), 1)
    per_sample = step_s / local_batch
    validation = math.ceil(valid / dp) * per_sample * VALIDATION_COST
    ends = []
    for share, sigma, overhead in ((1.0, SIGMA[0], EPOCH_OVERHEAD_S[0]),
                                   (FS_SHARE_LOW, SIGMA[1], EPOCH_OVERHEAD_S[1])):
        supply = min(per_node * NIC_PER_GPU, share * FS_BANDWIDTH / nodes)
        input_s = max(node_bytes / supply - step_s, 0.0)
        straggler = (step_s + input_s) * sigma * expected_max_normal(gpus)
        ends.append(Terms(step_s, input_s, straggler, (validation + overhead) / steps))
    return ends[0], ends[1]
