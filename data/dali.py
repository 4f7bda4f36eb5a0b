"""NVIDIA DALI data loader: the same batches as data/loader.py, read by DALI.

The HDF5 reads run in the worker processes of DALI's parallel external source, and the
normalisation is a DALI operator (on the GPU when there is one), so the training process only
receives ready batches. The result is interchangeable with the PyTorch loader:

    loader, dataset, sampler = get_data_loader_dali(cfg, path, train=True, batch_size=16)
    sampler.set_epoch(epoch)            # or set_epoch(epoch, skip_batches=k) to resume
    for inp, tar in loader:             # torch float32 (B, C, H, W): CPU, or CUDA on a GPU
        ...

How sample order, epochs and shards work:

* The sampler is the PyTorch loader's own `ShardSampler`: for each epoch, a permutation seeded
  with `seed + epoch` (the same on every rank), rank r takes every num_replicas-th sample of
  it, training drops the last partial batch. Batch b of epoch e on rank r is therefore the
  same set of samples in both loaders.
* A DALI pipeline sees one endless stream of samples: the source maps stream position p to
  position (p + start) mod L of epoch first_epoch + (p + start) // L, where L is the number of
  batches per epoch times the batch size. So the workers prefetch across epoch boundaries
  without stalling, and the order depends only on (seed, epoch), never on DALI's own counters.
* `for` over the loader yields the batches of `sampler.epoch` from `sampler.skip` on. If that
  is not where the pipeline's stream stands (the first epoch, a set_epoch that jumps, a loop
  left with `break`), the pipeline is rebuilt to start there; consecutive epochs never are.
* Validation keeps every sample of the shard: the last batch of an epoch is padded to the full
  batch size with zeros (DALI's per-sample source makes fixed-size batches) and the padding is
  cut off before the batch is returned, so the last batch may be smaller, as in PyTorch.

Workers are spawned, not forked (DALI's requirement when CUDA is used): the source below is a
class in this importable module, and the script that builds the loader needs the usual
`if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import copy
import logging
import os
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from data.dataset import ERA5Dataset, ShardSampler, dataset_and_sampler
from utils import devices
from utils.config_schema import Config
from utils.errors import ConfigError, DataError
from utils.tile import Tile

log = logging.getLogger(__name__)


class DALIUnavailableError(ConfigError):
    """data_loader_config is 'dali' but NVIDIA DALI cannot be imported."""


def require_dali() -> None:
    """Raise a one-line DALIUnavailableError unless `nvidia.dali` imports."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as e:
        raise DALIUnavailableError(
            f"data_loader_config 'dali' needs NVIDIA DALI ({e}): pip install "
            "nvidia-dali-cuda120, or use --data_loader_config pytorch") from None


class PairSource:
    """Stream position -> raw (input, target) pair, for DALI's per-sample external source.

    Called with a `nvidia.dali.types.SampleInfo` in the worker processes (a pickled copy per
    worker). The source never raises StopIteration, so `idx_in_epoch` is the position in the
    endless stream described in the module docstring.
    """

    def __init__(self, dataset: ERA5Dataset, sampler: ShardSampler, batches_per_epoch: int,
                 first_epoch: int, first_batch: int):
        self.dataset = dataset
        self.sampler = copy.copy(sampler)  # own copy: set_epoch here must not touch the user's
        self.samples_per_epoch = batches_per_epoch * sampler.batch_size
        self.shard_size = sampler.num_samples  # positions beyond it are padding
        self.first_epoch = first_epoch
        self.start = first_batch * sampler.batch_size
        self._epoch: int | None = None
        self._indices: list[int] = []
        C, (H, W) = dataset.n_channels, dataset.tile.shape
        self._zeros = np.zeros((C, H, W), dtype=np.float32)

    def epoch_indices(self, epoch: int) -> list[int]:
        """Dataset indices of this rank's shard of `epoch`, in order (cached per epoch)."""
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)  # skip_batches=0: the whole shard
            self._indices, self._epoch = list(self.sampler), epoch
        return self._indices

    def __call__(self, sample_info: Any) -> tuple[np.ndarray, np.ndarray]:
        lap, pos = divmod(sample_info.idx_in_epoch + self.start, self.samples_per_epoch)
        if pos >= self.shard_size:  # padding of the last validation batch, cut off later
            return self._zeros, self._zeros
        index = self.epoch_indices(self.first_epoch + lap)[pos]
        inp, tar = self.dataset.read_pair(index)
        return (np.ascontiguousarray(inp, dtype=np.float32),
                np.ascontiguousarray(tar, dtype=np.float32))


def _close_pipeline(pipe: Any) -> None:
    # DALI has no public close(): these are the calls its own finalizers make (backend first,
    # then the worker pool), done now so the workers exit with the loader, not at exit.
    pool = getattr(pipe, "_py_pool", None)
    pipe._shutdown()
    if pool is not None:
        pool.close()


class DALILoader:
    """Iterable over (inp, tar) batches of one shard; one `for` loop = the rest of one epoch."""

    def __init__(self, dataset: ERA5Dataset, sampler: ShardSampler, num_workers: int,
                 device: torch.device, num_threads: int = 2, prefetch: int = 2):
        self.dataset, self.sampler = dataset, sampler
        self.batch_size = sampler.batch_size
        self.shuffle = sampler.shuffle
        n = sampler.num_samples
        # Training drops the last partial batch; validation keeps it.
        full, rest = divmod(n, self.batch_size)
        self.batches_per_epoch = full if sampler.drop_last else full + (rest > 0)
        if self.batches_per_epoch == 0:
            raise DataError(f"{dataset.location}: this rank's shard has {n} samples, fewer "
                            f"than one batch of {self.batch_size}")
        self.num_workers, self.device = int(num_workers), device
        self.num_threads, self.prefetch = num_threads, prefetch
        means, stds = dataset.means, dataset.stds  # (C, 1, 1), broadcast over (C, H, W)
        self._stats = (np.ascontiguousarray(means), np.ascontiguousarray(stds))
        self._pipe: Any = None
        self._finalizer: weakref.finalize | None = None
        self._at: tuple[int, int] = (0, 0)  # (epoch, batch) the pipeline's next batch belongs to

    def __len__(self) -> int:
        return max(self.batches_per_epoch - self.sampler.skip // self.batch_size, 0)

    def _requested(self) -> tuple[int, int]:
        # Without shuffling every epoch has the same order: any epoch number will do.
        epoch = self.sampler.epoch if self.shuffle else self._at[0]
        return epoch, self.sampler.skip // self.batch_size

    def _build(self, epoch: int, batch: int) -> None:
        from nvidia.dali import fn, types
        from nvidia.dali.pipeline import Pipeline

        self.close()
        source = PairSource(self.dataset, self.sampler, self.batches_per_epoch, epoch, batch)
        on_gpu = self.device.type == "cuda"
        pipe = Pipeline(batch_size=self.batch_size, num_threads=self.num_threads,
                        device_id=self.device.index if on_gpu else None,
                        prefetch_queue_depth=self.prefetch,
                        py_num_workers=max(self.num_workers, 1), py_start_method="spawn")
        parallel = {}
        if self.num_workers > 0:  # these arguments are errors for a non-parallel source
            parallel = {"parallel": True, "prefetch_queue_depth": self.prefetch,
                        # shared memory sized for a sample up front (+ DALI's metadata)
                        "bytes_per_sample_hint": 2 * source._zeros.nbytes + 4096}
        with pipe:
            inp, tar = fn.external_source(source, num_outputs=2, batch=False, dtype=types.FLOAT,
                                          ndim=3, **parallel)
            if on_gpu:
                inp, tar = inp.gpu(), tar.gpu()
            dev = "gpu" if on_gpu else "cpu"
            mean = types.Constant(self._stats[0], device=dev)
            std = types.Constant(self._stats[1], device=dev)
            # (x - mean) / std as arithmetic ops: bit-identical to the PyTorch loader, which
            # fn.normalize (multiplies by 1 / std) is not.
            pipe.set_outputs((inp - mean) / std, (tar - mean) / std)
        pipe.build()  # starts the workers
        self._pipe, self._at = pipe, (epoch, batch)
        self._finalizer = weakref.finalize(self, _close_pipeline, pipe)

    def _to_torch(self, batch: Any, n: int) -> torch.Tensor:
        from nvidia.dali.plugin.pytorch import feed_ndarray

        dense = batch.as_tensor()
        out = torch.empty(dense.shape(), dtype=torch.float32, device=self.device)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        feed_ndarray(dense, out, cuda_stream=stream)
        return out[:n]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._at[1] >= self.batches_per_epoch:  # the last loop ended right at its last batch
            self._at = (self._at[0] + 1, 0)
        epoch, batch = self._requested()
        if batch >= self.batches_per_epoch:  # resumed at the very end of an epoch
            return
        if self._pipe is None or self._at != (epoch, batch):
            if self._pipe is not None:  # costs a worker start-up: worth a line in the log
                log.info(f"DALI pipeline restarted at epoch {epoch}, batch {batch} "
                         f"(it stood at epoch {self._at[0]}, batch {self._at[1]})")
            self._build(epoch, batch)
        for b in range(batch, self.batches_per_epoch):
            inp, tar = self._pipe.run()
            self._at = (epoch, b + 1)  # before yielding: a `break` leaves it consistent
            n = min(self.batch_size, self.sampler.num_samples - b * self.batch_size)
            yield self._to_torch(inp, n), self._to_torch(tar, n)
        self._at = (epoch + 1, 0)

    def close(self) -> None:
        """Stop the pipeline and its worker processes (also done at garbage collection)."""
        if self._finalizer is not None:
            self._finalizer()  # runs _close_pipeline once
            self._finalizer = None
        self._pipe = None


def get_data_loader_dali(cfg: Config, location: str, train: bool, num_replicas: int = 1,
                         rank: int = 0, tile: Tile | None = None, *, batch_size: int
                         ) -> tuple[DALILoader, ERA5Dataset, ShardSampler]:
    """Returns (loader, dataset, sampler), like `data.loader.get_data_loader`.

    `cfg.num_data_workers` worker processes read the files (0: the training process reads
    them itself); batches come out on the current CUDA device if there is one, else on the CPU.
    With a `tile`, the workers read only its rows and columns (as the PyTorch loader does).
    """
    require_dali()
    dataset, sampler = dataset_and_sampler(cfg, location, train, num_replicas, rank, tile,
                                           batch_size=batch_size)
    device = devices.current_gpu() if torch.cuda.is_available() else torch.device("cpu")
    workers = cfg.num_data_workers
    threads = max(1, min(4, os.cpu_count() or 1))
    loader = DALILoader(dataset, sampler, workers, device, num_threads=threads)
    return loader, dataset, sampler
