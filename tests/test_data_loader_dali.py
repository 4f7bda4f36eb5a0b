"""The DALI loader yields what the PyTorch loader yields: same samples, order, shards and
normalisation, with real DALI pipelines on the CPU (tiny data from conftest's `tiny_data`).

Starting DALI source workers costs seconds here (each is a fresh Python importing torch), so
most tests use num_data_workers=0 (the same source, called in the main process) and the worker
processes get dedicated tests (in the e2e tier, with the other tests that start interpreters).
"""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
import torch
from helpers import REPO, child_env

from data.dali import DALILoader, DALIUnavailableError, get_data_loader_dali
from data.loader import get_data_loader
from training.script_exit import run_main
from utils.errors import EXIT_USER_ERROR


def worker_pids(loader: DALILoader) -> list[int]:
    """Process ids of a DALILoader's running source workers (none without workers): DALI
    keeps its worker pool in a private attribute of the pipeline."""
    pool = getattr(loader._pipe, "_py_pool", None)
    return list(pool.pids()) if pool is not None else []

ATOL = 1e-6


def dali(params, train=True, workers=0, num_replicas=1, rank=0):
    params = params.replace(num_data_workers=workers)
    path = params.train_data_path if train else params.valid_data_path
    return get_data_loader_dali(params, path, train, num_replicas, rank,
                                batch_size=params.local_batch_size)


def sample_ids(batches, dataset) -> list[int]:
    """Dataset index of every sample in `batches`, found by comparing with dataset[i]."""
    items = [dataset[i] for i in range(len(dataset))]
    inputs = torch.stack([inp for inp, _ in items])
    ids = []
    for inp, tar in batches:
        for x, y in zip(inp, tar, strict=True):
            err = (inputs - x).abs().amax(dim=(1, 2, 3))
            i = int(err.argmin())
            assert err[i] <= ATOL and torch.allclose(items[i][1], y, rtol=0, atol=ATOL)
            ids.append(i)
    return ids


def reference_shard(n: int, seed: int, epoch: int, num_replicas: int, rank: int) -> list[int]:
    """DistributedSampler semantics: one permutation per (seed + epoch) on every rank, the
    tail that doesn't fill all ranks dropped, rank r takes every num_replicas-th index."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    total = n - n % num_replicas
    return perm[rank:total:num_replicas]


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.e2e)])
def test_same_batches_as_pytorch_loader(tiny_params, workers):
    tiny_params = tiny_params.replace(num_data_workers=0)
    ref_loader, _, ref_sampler = get_data_loader(tiny_params, tiny_params.train_data_path,
                                                 train=True,
                                                 batch_size=tiny_params.local_batch_size)
    loader, _, sampler = dali(tiny_params, workers=workers)
    assert len(loader) == len(ref_loader) == 32 // 4
    for epoch in (1, 2):
        sampler.set_epoch(epoch)
        ref_sampler.set_epoch(epoch)
        n = 0
        for (inp, tar), (ref_inp, ref_tar) in zip(loader, ref_loader, strict=True):
            assert inp.dtype == torch.float32 and inp.device.type == "cpu"
            assert inp.shape == ref_inp.shape == (4, 20, 16, 32)
            torch.testing.assert_close(inp, ref_inp, rtol=0, atol=ATOL)
            torch.testing.assert_close(tar, ref_tar, rtol=0, atol=ATOL)
            n += 1
        assert n == 8
    # Clean shutdown: close() ends the source workers.
    pids = worker_pids(loader)
    assert len(pids) == workers
    procs = [psutil.Process(p) for p in pids]
    loader.close()
    _, alive = psutil.wait_procs(procs, timeout=20)
    assert not alive, f"workers still running after close(): {alive}"


def test_validation_sees_every_sample_once_with_partial_last_batch(tiny_params):
    # 23 (t, t+dt) pairs: 5 batches of 4 and one of 3
    tiny_params = tiny_params.replace(limit_nsamples_val=None)
    loader, dataset, _ = dali(tiny_params, train=False)
    tiny_params = tiny_params.replace(num_data_workers=0)
    ref_loader, _, _ = get_data_loader(tiny_params, tiny_params.valid_data_path,
                                       train=False, batch_size=tiny_params.local_batch_size)
    assert len(dataset) == 23 and len(loader) == len(ref_loader) == 6
    for _ in range(2):  # the second pass must not see leftovers of the first
        batches = list(loader)
        assert [b[0].shape[0] for b in batches] == [4, 4, 4, 4, 4, 3]
        assert sample_ids(batches, dataset) == list(range(23))
        for (inp, tar), (ref_inp, ref_tar) in zip(batches, ref_loader, strict=True):
            torch.testing.assert_close(inp, ref_inp, rtol=0, atol=ATOL)
            torch.testing.assert_close(tar, ref_tar, rtol=0, atol=ATOL)


def test_two_shards_are_disjoint_and_cover_the_epoch(tiny_params):
    seed, epoch = int(tiny_params.seed), 3
    seen = []
    for rank in (0, 1):
        loader, dataset, sampler = dali(tiny_params, num_replicas=2, rank=rank)
        assert len(loader) == 32 // 2 // 4
        sampler.set_epoch(epoch)
        ids = sample_ids(list(loader), dataset)
        assert ids == reference_shard(len(dataset), seed, epoch, 2, rank)
        seen.append(set(ids))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(range(32))


def test_order_depends_only_on_the_epoch(tiny_params):
    loader, dataset, sampler = dali(tiny_params)
    orders = {}
    for epoch in (1, 2, 1):  # going back to epoch 1 rebuilds the pipeline at its start
        sampler.set_epoch(epoch)
        order = sample_ids(list(loader), dataset)
        assert orders.setdefault(epoch, order) == order
        assert order == reference_shard(32, int(tiny_params.seed), epoch, 1, 0)
    assert orders[1] != orders[2]
    # Resuming mid-epoch (a checkpoint at batch 3) gives the rest of the same order.
    sampler.set_epoch(2, skip_batches=3)
    assert len(loader) == 8 - 3
    assert sample_ids(list(loader), dataset) == orders[2][3 * 4:]
    # A loop left with `break` does not leak batches into the next epoch.
    sampler.set_epoch(1)
    next(iter(loader))
    sampler.set_epoch(2)
    assert sample_ids(list(loader), dataset) == orders[2]


def test_limit_nsamples(tiny_params):
    # train drops the last partial batch: 2 batches of 4
    tiny_params = tiny_params.replace(limit_nsamples=10)
    loader, dataset, sampler = dali(tiny_params)
    sampler.set_epoch(1)
    batches = list(loader)
    assert len(dataset) == 10 and len(loader) == len(batches) == 2
    ids = sample_ids(batches, dataset)
    assert ids == reference_shard(10, int(tiny_params.seed), 1, 1, 0)[:8]
    val_loader, val_set, _ = dali(tiny_params, train=False)  # limit_nsamples_val: 8
    assert len(val_set) == 8 and sample_ids(list(val_loader), val_set) == list(range(8))


def test_missing_dali_is_a_one_line_config_error(tiny_params, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # `import nvidia.dali` now fails
    with pytest.raises(DALIUnavailableError, match="pip install nvidia-dali-cuda120"):
        dali(tiny_params)
    with pytest.raises(SystemExit) as exit_info:
        run_main(lambda argv: dali(tiny_params), [])
    assert exit_info.value.code == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "nvidia-dali-cuda120" in err


@pytest.mark.e2e
def test_workers_exit_with_the_process(tiny_data):
    """A script that never calls close() (like train.py) leaves no worker processes behind."""
    script = (
        "from utils.config import read_config\n"
        "from data.dali import get_data_loader_dali\n"
        f"p = read_config({str(REPO / 'config' / 'ViT.yaml')!r}, 'tiny')\n"
        "p = p.replace(num_data_workers=1)\n"
        "loader, _, sampler = get_data_loader_dali(p, p.train_data_path, True, batch_size=4)\n"
        "sampler.set_epoch(1)\n"
        "next(iter(loader))  # leaves the epoch (and the workers' prefetching) unfinished\n"
        "print(*loader._pipe._py_pool.pids())  # the source workers (test's worker_pids)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=child_env({"DATA_DIR": str(tiny_data)}))
    assert proc.returncode == 0, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, f"worker processes outlived their parent: {alive}"


@pytest.mark.e2e
def test_train_tiny_with_dali(run_train):
    rc, out = run_train("train.py", ["--config=tiny", "--data_loader_config", "dali",
                                     "--num_data_workers", "1"], timeout=240)
    assert rc == 0, out[-3000:]
    assert "Time taken for epoch" in out
