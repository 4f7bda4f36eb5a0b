"""utils/data_loader.py on the tiny synthetic data set, checked against direct h5py reads."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import torch
from helpers import TINY_IMG_SIZE, TINY_SAMPLES_PER_YEAR, one_line

from data.loader import ERA5Dataset, get_data_loader
from utils.errors import DataError

N = TINY_SAMPLES_PER_YEAR
C = 20


def train_files(tiny_data) -> list[str]:
    return sorted(str(p) for p in (tiny_data / "train").glob("*.h5"))


def h5_sample(path: str, i: int) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["fields"][i]


def stats(tiny_data) -> tuple[np.ndarray, np.ndarray]:
    means = np.load(tiny_data / "stats" / "global_means.npy")[0]
    stds = np.load(tiny_data / "stats" / "global_stds.npy")[0]
    return means, stds


def unlimited(params):
    params = params.replace(limit_nsamples=None)
    params = params.replace(limit_nsamples_val=None)
    return params


# ----------------------------------------------------------------- pairs and normalisation

def test_tiny_data_layout(tiny_data):
    assert len(train_files(tiny_data)) == 2
    with h5py.File(train_files(tiny_data)[0], "r") as f:
        assert f["fields"].shape == (N, C, *TINY_IMG_SIZE)
        assert f["fields"].dtype == np.float32


@pytest.mark.parametrize("dt", [1, 2])
def test_pairs_are_t_and_t_plus_dt_within_and_across_year_files(tiny_params, tiny_data, dt):
    params = unlimited(tiny_params)
    params = params.replace(dt=dt)
    ds = ERA5Dataset(params, params.train_data_path, train=True)
    per_file = N - dt  # a pair never spans two years
    assert len(ds) == 2 * per_file
    f0, f1 = train_files(tiny_data)
    expected = {
        0: (f0, 0),
        1: (f0, 1),
        per_file - 1: (f0, per_file - 1),  # last pair of year 1: target is its last sample
        per_file: (f1, 0),                 # first pair of year 2
        2 * per_file - 1: (f1, per_file - 1),
    }
    for index, (path, local) in expected.items():
        assert ds.locate(index) == (train_files(tiny_data).index(path), local)
        inp, tar = ds.read_pair(index)
        np.testing.assert_array_equal(inp, h5_sample(path, local))
        np.testing.assert_array_equal(tar, h5_sample(path, local + dt))
    with pytest.raises(IndexError):
        ds.read_pair(len(ds))


def test_items_are_normalised_with_the_global_stats(tiny_params, tiny_data):
    ds = ERA5Dataset(unlimited(tiny_params), tiny_params.train_data_path, train=True)
    means, stds = stats(tiny_data)
    f1 = train_files(tiny_data)[1]
    inp, tar = ds[N - 1]  # first pair of the second year
    assert inp.dtype == torch.float32 and inp.shape == (C, *TINY_IMG_SIZE)
    np.testing.assert_allclose(inp.numpy(), (h5_sample(f1, 0) - means) / stds, rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_allclose(tar.numpy(), (h5_sample(f1, 1) - means) / stds, rtol=1e-6,
                               atol=1e-6)


def test_normalised_training_data_has_mean_0_and_std_1_per_channel(tiny_params):
    """The stats are over every training sample: the pairs' inputs plus each year's last
    target are exactly those samples."""
    ds = ERA5Dataset(unlimited(tiny_params), tiny_params.train_data_path, train=True)
    per_file = N - 1
    x = torch.stack([ds[i][0] for i in range(len(ds))]
                    + [ds[per_file - 1][1], ds[2 * per_file - 1][1]])
    assert x.shape[0] == 2 * N
    per_channel = x.transpose(0, 1).reshape(C, -1).double()
    torch.testing.assert_close(per_channel.mean(1), torch.zeros(C, dtype=torch.float64),
                               rtol=0, atol=1e-3)
    torch.testing.assert_close(per_channel.std(1, correction=0),
                               torch.ones(C, dtype=torch.float64), rtol=0, atol=1e-3)


def test_cropping_to_a_smaller_img_size_keeps_the_top_left_corner(tiny_params, tiny_data):
    params = unlimited(tiny_params)
    params = params.replace(img_size=[8, 20])
    ds = ERA5Dataset(params, params.train_data_path, train=True)
    means, stds = stats(tiny_data)
    f0 = train_files(tiny_data)[0]
    inp, tar = ds[3]
    assert inp.shape == tar.shape == (C, 8, 20)
    np.testing.assert_allclose(inp.numpy(), ((h5_sample(f0, 3) - means) / stds)[:, :8, :20],
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(tar.numpy(), ((h5_sample(f0, 4) - means) / stds)[:, :8, :20],
                               rtol=1e-6, atol=1e-6)


def test_limit_nsamples_applies_to_train_and_limit_nsamples_val_to_validation(tiny_params):
    p = tiny_params
    p = p.replace(limit_nsamples=10, limit_nsamples_val=6)
    assert len(ERA5Dataset(p, p.train_data_path, train=True)) == 10
    assert len(ERA5Dataset(p, p.valid_data_path, train=False)) == 6
    p = p.replace(limit_nsamples=10_000, limit_nsamples_val=None)  # more than there is: all of it
    assert len(ERA5Dataset(p, p.train_data_path, train=True)) == 2 * (N - 1)
    assert len(ERA5Dataset(p, p.valid_data_path, train=False)) == N - 1


# ----------------------------------------------------------------- loaders and samplers

def batches(params, epoch: int, **kw) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader, _, sampler = get_data_loader(params, params.train_data_path, train=True, **kw,
                                         batch_size=params.local_batch_size)
    sampler.set_epoch(epoch)
    return list(loader)


def test_two_workers_yield_the_same_batches_as_zero(tiny_params):
    p = tiny_params
    p = p.replace(limit_nsamples=16, local_batch_size=4)
    p = p.replace(num_data_workers=0)
    serial = batches(p, epoch=3)
    p = p.replace(num_data_workers=2)
    parallel = batches(p, epoch=3)
    assert len(serial) == len(parallel) == 4
    for (a_in, a_tar), (b_in, b_tar) in zip(serial, parallel, strict=True):
        assert a_in.shape == (4, C, *TINY_IMG_SIZE)
        assert torch.equal(a_in, b_in) and torch.equal(a_tar, b_tar)


def test_sample_order_depends_only_on_seed_and_epoch(tiny_params):
    p = tiny_params
    p = p.replace(limit_nsamples=16, local_batch_size=4)
    a, b, c = batches(p, 1), batches(p, 1), \
        batches(p, 2)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c, strict=True))


def test_set_epoch_can_skip_the_batches_already_done(tiny_params):
    """Resuming mid-epoch: the rest of the epoch is exactly the uninterrupted run's tail."""
    p = tiny_params
    p = p.replace(limit_nsamples=16, local_batch_size=4)
    loader, _, sampler = get_data_loader(p, p.train_data_path, train=True,
                                         batch_size=p.local_batch_size)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_epoch(2, skip_batches=3)
    assert list(sampler) == full[12:] and len(sampler) == 4
    (inp, _), = list(loader)
    assert inp.shape[0] == 4
    sampler.set_epoch(2)  # a new epoch starts from its beginning again
    assert list(sampler) == full


def test_distributed_shards_for_two_replicas_are_disjoint_and_cover_the_epoch(tiny_params):
    p = tiny_params
    p = p.replace(limit_nsamples=16, local_batch_size=4)
    shards = []
    for rank in (0, 1):
        loader, ds, sampler = get_data_loader(p, p.train_data_path,
                                              train=True, num_replicas=2, rank=rank,
                                              batch_size=p.local_batch_size)
        sampler.set_epoch(5)
        indices = list(sampler)
        assert len(indices) == len(ds) // 2 == 8
        # the loader yields exactly those samples, in that order
        got = torch.cat([inp for inp, _ in loader])
        want = torch.stack([ds[i][0] for i in indices])
        assert torch.equal(got, want)
        shards.append(set(indices))
    assert not shards[0] & shards[1]
    assert shards[0] | shards[1] == set(range(16))


def test_validation_is_not_shuffled_and_keeps_the_last_partial_batch(tiny_params):
    p = tiny_params
    p = p.replace(limit_nsamples_val=6, local_batch_size=4)
    loader, ds, sampler = get_data_loader(p, p.valid_data_path, train=False,
                                          batch_size=p.local_batch_size)
    assert list(sampler) == list(range(6))
    assert [inp.shape[0] for inp, _ in loader] == [4, 2]


# ----------------------------------------------------------------- errors

def write_fields(path, shape, name="fields") -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with h5py.File(path, "w") as f:
        f.create_dataset(name, data=np.zeros(shape, dtype=np.float32))
    return str(path)


def test_missing_directory(tiny_params, tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError) as e:
        ERA5Dataset(tiny_params, str(missing), train=True)
    msg = one_line(e)
    assert str(missing) in msg and "DATA_DIR" in msg


def test_directory_without_h5_files(tiny_params, tmp_path):
    (tmp_path / "notes.txt").write_text("no data here")
    with pytest.raises(DataError) as e:
        ERA5Dataset(tiny_params, str(tmp_path), train=True)
    assert f"no .h5 files in {tmp_path}" in one_line(e)


def test_file_without_a_fields_dataset(tiny_params, tmp_path):
    path = write_fields(tmp_path / "2016.h5", (4, C, 16, 32), name="data")
    with pytest.raises(DataError) as e:
        ERA5Dataset(tiny_params, str(tmp_path), train=True)
    msg = one_line(e)
    assert path in msg and "'fields'" in msg and "data" in msg


def test_fields_with_the_wrong_number_of_dimensions(tiny_params, tmp_path):
    path = write_fields(tmp_path / "2016.h5", (4, C, 16))
    with pytest.raises(DataError) as e:
        ERA5Dataset(tiny_params, str(tmp_path), train=True)
    assert path in one_line(e) and "(4, 20, 16)" in str(e.value)


def test_channel_count_mismatch(tiny_params, tmp_path):
    path = write_fields(tmp_path / "2016.h5", (4, 3, 16, 32))
    with pytest.raises(DataError) as e:
        ERA5Dataset(tiny_params, str(tmp_path), train=True)
    msg = one_line(e)
    assert path in msg and "3 channels" in msg and "20" in msg


def test_img_size_larger_than_the_data(tiny_params):
    tiny_params = tiny_params.replace(img_size=[32, 64])
    with pytest.raises(DataError) as e:
        ERA5Dataset(tiny_params, tiny_params.train_data_path, train=True)
    msg = one_line(e)
    assert "2016.h5" in msg and "16x32" in msg and "32x64" in msg


def test_too_few_samples_for_one_pair(tiny_params, tmp_path):
    write_fields(tmp_path / "2016.h5", (1, C, 16, 32))
    with pytest.raises(DataError) as e:
        ERA5Dataset(tiny_params, str(tmp_path), train=True)
    assert str(tmp_path) in one_line(e) and "t+1" in str(e.value)


def test_non_hdf5_file(tiny_params, tmp_path):
    path = tmp_path / "2016.h5"
    path.write_text("this is not HDF5\n")
    with pytest.raises(DataError) as e:
        ERA5Dataset(tiny_params, str(tmp_path), train=True)
    msg = one_line(e)
    assert str(path) in msg and "HDF5" in msg


@pytest.mark.parametrize("shape", [(1, 5, 1, 1), (20,), (2, 20, 1, 1)])
def test_stats_shape_mismatch(tiny_params, tmp_path, shape):
    path = tmp_path / "global_means.npy"
    np.save(path, np.zeros(shape, dtype=np.float32))
    tiny_params = tiny_params.replace(global_means_path=str(path))
    with pytest.raises(DataError) as e:
        ERA5Dataset(tiny_params, tiny_params.train_data_path, train=True)
    msg = one_line(e)
    assert str(path) in msg and str(shape) in msg


def test_per_pixel_global_stds_are_rejected(tiny_params, tmp_path):
    path = tmp_path / "global_stds.npy"
    np.save(path, np.ones((1, C, 16, 32), dtype=np.float32))
    tiny_params = tiny_params.replace(global_stds_path=str(path))
    with pytest.raises(DataError) as e:
        ERA5Dataset(tiny_params, tiny_params.train_data_path, train=True)
    assert "(1, 20, 16, 32)" in one_line(e)


def test_missing_stats_file(tiny_params, tmp_path):
    tiny_params = tiny_params.replace(global_stds_path=str(tmp_path / "stds.npy"))
    with pytest.raises(DataError) as e:
        ERA5Dataset(tiny_params, tiny_params.train_data_path, train=True)
    assert str(tmp_path / "stds.npy") in one_line(e)


def test_validation_shards_count_every_sample_exactly_once(tiny_params):
    """No padding with repeated samples: an uneven split leaves one rank a sample short."""
    tiny_params = tiny_params.replace(limit_nsamples_val=7)
    seen = []
    for rank in range(2):
        _, dataset, sampler = get_data_loader(tiny_params, tiny_params.valid_data_path,
                                              train=False,
                                              num_replicas=2, rank=rank,
                                              batch_size=tiny_params.local_batch_size)
        seen.append(list(sampler))
        assert len(sampler) == len(seen[-1])
    assert sorted(seen[0] + seen[1]) == list(range(7))
