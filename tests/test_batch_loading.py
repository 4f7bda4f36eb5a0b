"""Batch-at-once reading (data/batch_read.py) and the prefetch thread
(data/prefetch.py): the same batches as one sample at a time, and resume stays exact.

Reference: `ERA5Dataset.__getitem__` (two HDF5 reads and numpy normalisation per sample),
stacked. The DALI loader is compared with the batched PyTorch loader in
test_data_loader_dali.py.
"""

from __future__ import annotations

import os
import threading

import h5py
import numpy as np
import pytest
import torch
from helpers import (
    REFERENCE_ARGS,
    TINY_SAMPLES_PER_YEAR,
    assert_completed,
    assert_same_state,
    epoch_losses,
    final_checkpoint,
    run_script,
)

from data import batch_read
from data.batch_read import read_batch, runs
from data.loader import ERA5Dataset, get_data_loader, get_loader
from data.mapped import mapped_fields
from data.prefetch import PrefetchLoader
from utils.errors import DataError

N = TINY_SAMPLES_PER_YEAR


def per_sample(ds: ERA5Dataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [ds[i] for i in indices]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def assert_same_batch(got, expected) -> None:
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype == torch.float32 and g.is_contiguous()
        assert torch.equal(g, e)


@pytest.fixture(params=["mapped", "hdf5"])
def read_path(request, monkeypatch) -> str:
    """A test that takes it runs twice: samples read from the memory-mapped file, and (as
    for files that cannot be mapped) through h5py hyperslabs."""
    if request.param == "hdf5":
        monkeypatch.setattr(batch_read, "mapped", lambda path: None)
    return request.param


@pytest.fixture
def dataset(tiny_params) -> ERA5Dataset:
    tiny_params = tiny_params.replace(limit_nsamples=None)
    return ERA5Dataset(tiny_params, tiny_params.train_data_path, train=True)


# ----------------------------------------------------------------- reading a batch


@pytest.mark.parametrize("dt", [1, 3])
def test_shuffled_batch_equals_per_sample_reads(tiny_params, dt, read_path):
    tiny_params = tiny_params.replace(dt=dt, limit_nsamples=None)
    ds = ERA5Dataset(tiny_params, tiny_params.train_data_path, train=True)
    indices = np.random.default_rng(dt).permutation(len(ds))[:7].tolist()
    assert_same_batch(read_batch(ds, indices), per_sample(ds, indices))


@pytest.mark.parametrize("dt", [1, 3])
def test_consecutive_samples_are_one_run_even_across_a_year_file(tiny_params, dt, read_path):
    tiny_params = tiny_params.replace(dt=dt, limit_nsamples=None)
    ds = ERA5Dataset(tiny_params, tiny_params.train_data_path, train=True)
    per_file = N - dt
    indices = list(range(per_file - 2, per_file + 3))  # the last 2 of year 1, 3 of year 2
    assert [(r.file, r.start, r.n, r.row) for r in runs(ds, indices)] == [
        (0, per_file - 2, 2, 0), (1, 0, 3, 2)]
    assert_same_batch(read_batch(ds, indices), per_sample(ds, indices))
    # runs shorter than dt (two hyperslabs), longer (one), mixed with single samples
    mixed = [5, 0, 1, 2, 3, 4, 11, 12]
    assert_same_batch(read_batch(ds, mixed), per_sample(ds, mixed))


def test_cropped_img_size_reads_the_top_left_corner(tiny_params, read_path):
    tiny_params = tiny_params.replace(img_size=[8, 16])
    ds = ERA5Dataset(tiny_params, tiny_params.train_data_path, train=True)
    inp, tar = read_batch(ds, [3, 1, 2])
    assert inp.shape == tar.shape == (3, 20, 8, 16)
    assert_same_batch((inp, tar), per_sample(ds, [3, 1, 2]))


@pytest.mark.parametrize("train", [True, False])
def test_data_loader_batches_equal_per_sample_reads(tiny_params, train, read_path):
    path = tiny_params.train_data_path if train else tiny_params.valid_data_path
    loader, ds, sampler = get_data_loader(tiny_params, path, train=train,
                                          batch_size=tiny_params.local_batch_size)
    sampler.set_epoch(3)
    order = list(sampler)
    B = tiny_params.local_batch_size
    batches = list(loader)
    assert len(batches) == len(loader) > 1
    for b, batch in enumerate(batches):
        assert_same_batch(batch, per_sample(ds, order[b * B:(b + 1) * B]))


# ----------------------------------------------------------------- memory-mapped files


def write_fields(path, data: np.ndarray, **options) -> str:
    with h5py.File(path, "w") as f:
        f.create_dataset("fields", data=data, **options)
    return str(path)


@pytest.mark.parametrize("layout", [{"chunks": (1, 3, 4, 5)}, {}])  # chunked, contiguous
def test_mapped_samples_are_the_files_bytes(tmp_path, layout):
    data = np.random.default_rng(0).standard_normal((6, 3, 4, 5)).astype(np.float32)
    fields = mapped_fields(write_fields(tmp_path / "a.h5", data, **layout))
    assert fields is not None
    for i in range(6):
        view = fields.sample(i)
        assert not view.flags.writeable and np.array_equal(view, data[i])


@pytest.mark.parametrize("options", [
    {"chunks": (1, 3, 4, 5), "compression": "gzip"},   # filtered bytes
    {"chunks": (2, 3, 4, 5)},                          # two samples per chunk
    {"chunks": (1, 3, 2, 5)},                          # a sample over several chunks
    {"dtype": np.float64},                             # not float32
])
def test_files_that_cannot_be_mapped_are_left_to_h5py(tmp_path, options):
    options = dict(options)
    data = np.ones((4, 3, 4, 5), dtype=options.pop("dtype", np.float32))
    assert mapped_fields(write_fields(tmp_path / "b.h5", data, **options)) is None


def test_a_truncated_file_is_not_mapped(tmp_path):
    path = write_fields(tmp_path / "c.h5", np.ones((4, 3, 4, 5), np.float32),
                        chunks=(1, 3, 4, 5))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    assert mapped_fields(path) is None


# ----------------------------------------------------------------- the prefetch thread


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "batch prefetch"]


def test_prefetch_thread_yields_the_loaders_batches_in_order(tiny_params, read_path):
    tiny_params = tiny_params.replace(prefetch_thread=True)
    loader, _, sampler = get_loader(tiny_params, tiny_params.train_data_path, train=True,
                                    batch_size=tiny_params.local_batch_size)
    plain, _, plain_sampler = get_data_loader(tiny_params, tiny_params.train_data_path,
                                              train=True, batch_size=tiny_params.local_batch_size)
    assert isinstance(loader, PrefetchLoader) and len(loader) == len(plain)
    assert loader.batch_size == plain.batch_size  # attributes pass through
    per_epoch = len(plain)
    for epoch, skip in ((1, 0), (2, 1)):  # a mid-epoch start as a resume makes it
        sampler.set_epoch(epoch, skip_batches=skip)
        plain_sampler.set_epoch(epoch, skip_batches=skip)
        got, expected = list(loader), list(plain)
        assert len(got) == len(expected) == per_epoch - skip
        for g, e in zip(got, expected, strict=True):
            assert_same_batch(g, e)
    assert not prefetch_threads()


def test_leaving_the_loop_early_stops_the_thread(tiny_params):
    loader = PrefetchLoader(get_data_loader(tiny_params, tiny_params.train_data_path, train=True,
                                            batch_size=tiny_params.local_batch_size)[0],
                            depth=1)
    for _ in loader:
        assert len(prefetch_threads()) == 1
        break
    assert not prefetch_threads()


def test_a_read_error_in_the_thread_reaches_the_training_loop(tiny_params, dataset):
    class Broken:
        def __len__(self) -> int:
            return 2

        def __iter__(self):
            yield dataset[0]
            raise DataError("sample 1 cannot be read")

    got = []
    with pytest.raises(DataError, match="sample 1 cannot be read"):
        for batch in PrefetchLoader(Broken()):
            got.append(batch)
    assert len(got) == 1 and not prefetch_threads()


# ----------------------------------------------------------------- training with it


@pytest.mark.e2e
def test_prefetch_thread_trains_and_resumes_exactly_like_the_plain_loader(
        serial_reference, tiny_data, tmp_path_factory):
    """The same run with the thread: bitwise the plain run's final state; then resumed
    mid-epoch (iteration 12 of 16, epoch 2 of 8-batch epochs) from its own checkpoint."""
    plain = [a for a in REFERENCE_ARGS if a != "--resume"]
    run = run_script("train.py", [*plain, "--prefetch_thread"], data_dir=tiny_data,
                     timeout=240, log_dir=tmp_path_factory.mktemp("prefetch"))
    assert_completed(run, 16)
    reference = final_checkpoint(serial_reference.exp_dir())
    assert_same_state(final_checkpoint(run.exp_dir()), reference)
    assert epoch_losses(run.stdout) == epoch_losses(serial_reference.stdout)

    ckpt12 = run.exp_dir() / "checkpoints" / "ckpt_00000012.pt"
    resumed = run_script("train.py", [*plain, f"--resume={ckpt12}", "--prefetch_thread"],
                         data_dir=tiny_data, timeout=240,
                         log_dir=tmp_path_factory.mktemp("prefetch_resumed"))
    assert_completed(resumed, 16)
    assert "iteration 12, epoch 2, 4 batches into it" in resumed.stdout
    assert_same_state(final_checkpoint(resumed.exp_dir()), reference)
