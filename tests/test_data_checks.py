"""data/checks.py and data/statistics.py's checks on real files: statistics that cannot
normalise, fields of another type read as float32 identically by the PyTorch and DALI
loaders, a damaged compressed chunk named by file and sample (also from a DataLoader worker
process), and the scan that names the sample behind a NaN/inf loss. End-to-end runs of the
same cases: test_errors.py.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from bad_data import copy_data, damage_chunk, rewrite, set_value

from data.checks import BatchScan
from data.loader import get_data_loader, get_loader
from data.statistics import check_stats, load_stats, load_stds
from utils.errors import DataError, from_worker, message_of


def point_at(params, data):
    """`params` reading the data set in `data`."""
    paths = {f"{split}_data_path": str(data / split) for split in ("train", "valid")}
    paths |= {f"{name}_path": str(data / "stats" / f"{name}.npy")
              for name in ("global_means", "global_stds", "time_means")}
    return params.replace(**paths)


# ----------------------------------------------------------------------------- statistics

@pytest.mark.parametrize("value, words", [
    (np.nan, ["channel 4 (msl)", "1 NaN value", "finite"]),
    (np.inf, ["channel 4 (msl)", "1 inf value", "finite"]),
    (0.0, ["channel 4 (msl) is 0", "> 0"]),
    (-2.5, ["channel 4 (msl) is -2.5", "> 0"]),
])
def test_stds_that_cannot_normalise_name_the_file_and_channel(tmp_path, value, words):
    stds = np.ones((1, 20, 1, 1), np.float32)
    stds[0, 4] = value
    path = tmp_path / "global_stds.npy"
    np.save(path, stds)
    with pytest.raises(DataError) as e:
        load_stds(str(path), 20)
    message = str(e.value)
    assert str(path) in message and "\n" not in message
    for word in words:
        assert word in message, (word, message)


def test_means_and_time_means_must_be_finite_but_may_be_zero_or_negative(tmp_path):
    stats = np.zeros((1, 20, 4, 8), np.float32)
    stats[0, 2] = -3.0
    np.save(tmp_path / "ok.npy", stats)
    assert load_stats(str(tmp_path / "ok.npy"), 20, "time means").shape == (1, 20, 4, 8)
    stats[0, 19, 3, 7] = np.nan
    np.save(tmp_path / "bad.npy", stats)
    with pytest.raises(DataError, match=r"time means .*bad\.npy: channel 19 \(tcwv\) has 1 NaN"):
        load_stats(str(tmp_path / "bad.npy"), 20, "time means")


def test_float64_stats_that_overflow_float32_are_caught(tmp_path):
    stats = np.ones((1, 20, 1, 1), np.float64)
    stats[0, 0] = 1e300  # finite in float64, inf once the loader makes it float32
    np.save(tmp_path / "global_means.npy", stats)
    with pytest.raises(DataError, match=r"channel 0 \(u10\) has 1 inf"):
        load_stats(str(tmp_path / "global_means.npy"), 20, "global means")
    assert check_stats(np.ones((1, 3, 1, 1)), "x.npy", "global stds", positive=True).shape \
        == (1, 3, 1, 1)


# ----------------------------------------------------------------------------- field types

def epoch_batches(loader, sampler, epoch: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    sampler.set_epoch(epoch)
    return [(inp.clone(), tar.clone()) for inp, tar in loader]


@pytest.mark.parametrize("dtype", ["f8", "i2"])
def test_fields_of_another_type_give_float32_batches_alike_in_both_loaders(
        tiny_params, tiny_data, tmp_path, caplog, dtype):
    """Stored float64 or int16 fields: both loaders read them as float32 (the same values
    as the stored numbers, converted), with one notice; before, the PyTorch loader gave
    the model float64 (and crashed) while DALI converted silently."""
    data = copy_data(tiny_data, tmp_path / "data")
    stored = {year: rewrite(data / "train" / f"{year}.h5", dtype=dtype) for year in (2016, 2017)}
    tiny_params = point_at(tiny_params, data)
    with caplog.at_level(logging.INFO, logger="data.checks"):
        torch_loader, dataset, torch_sampler = get_data_loader(
            tiny_params, tiny_params.train_data_path, True,
            batch_size=tiny_params.local_batch_size)
        tiny_params = tiny_params.replace(data_loader_config="dali")
        dali_loader, _, dali_sampler = get_loader(tiny_params, tiny_params.train_data_path, True,
                                                  batch_size=tiny_params.local_batch_size)
    notices = [r.message for r in caplog.records if "Notice" in r.message]
    assert len(notices) <= 1 and all(np.dtype(dtype).name in n for n in notices)
    pytorch, dali = epoch_batches(torch_loader, torch_sampler), epoch_batches(dali_loader,
                                                                             dali_sampler)
    dali_loader.close()
    assert len(pytorch) == len(dali) == len(torch_loader)
    for (a_in, a_tar), (b_in, b_tar) in zip(pytorch, dali, strict=True):
        assert a_in.dtype == b_in.dtype == torch.float32
        assert torch.equal(a_in, b_in) and torch.equal(a_tar, b_tar)
    # The values are the stored numbers, normalised in float32.
    inp, _ = dataset[0]
    raw = stored[2016][0, :, :16, :32].astype(np.float32)
    expected = (raw - dataset.means) / dataset.stds
    np.testing.assert_array_equal(inp.numpy(), expected)


def test_one_notice_per_stored_type_in_a_process(tiny_params, tiny_data, tmp_path, caplog):
    data = copy_data(tiny_data, tmp_path / "data")
    for split, year in (("train", 2016), ("train", 2017), ("valid", 2018)):
        rewrite(data / split / f"{year}.h5", dtype="u2")
    tiny_params = point_at(tiny_params, data)
    with caplog.at_level(logging.INFO, logger="data.checks"):
        get_data_loader(tiny_params, tiny_params.train_data_path, True,
                        batch_size=tiny_params.local_batch_size)
        get_data_loader(tiny_params, tiny_params.valid_data_path, False,
                        batch_size=tiny_params.local_batch_size)
    notices = [r.message for r in caplog.records if "uint16" in r.message]
    assert len(notices) == 1, notices
    assert "2016.h5 and 1 more file(s)" in notices[0]


# ----------------------------------------------------------------------------- read errors

@pytest.mark.parametrize("workers", [0, 1])
def test_a_damaged_chunk_names_the_file_and_sample(tiny_params, tiny_data, tmp_path, workers):
    data = copy_data(tiny_data, tmp_path / "data")
    bad = data / "train" / "2016.h5"
    rewrite(bad, compression="gzip")
    damage_chunk(bad, row=3)
    tiny_params = point_at(tiny_params, data)
    tiny_params = tiny_params.replace(num_data_workers=workers)
    loader, _, sampler = get_data_loader(tiny_params, tiny_params.train_data_path, True,
                                         batch_size=tiny_params.local_batch_size)
    with pytest.raises(DataError) as e:
        epoch_batches(loader, sampler)
    # A worker's error comes back wrapped in its traceback: message_of unwraps it.
    message = message_of(e.value)
    assert message.startswith(f"{bad}: cannot read sample 3 of 'fields'"), message
    assert "\n" not in message and "filter returned failure" in message


def test_a_user_error_from_a_dali_worker_is_recovered_from_its_traceback():
    text = ("\n\nException traceback received from worker thread:\n\nTraceback (most recent "
            "call last):\n  File \"x.py\", line 1, in f\n    raise DataError(...)\n"
            "utils.errors.DataError: data/train/2016.h5: cannot read sample 3 of 'fields'\n")
    error = from_worker(Exception(text))
    assert isinstance(error, DataError)
    assert str(error) == "data/train/2016.h5: cannot read sample 3 of 'fields'"
    assert from_worker(RuntimeError("Traceback (most recent call last):\nKeyError: 'x'")) \
        is None
    assert from_worker(ValueError("plain")) is None


# ----------------------------------------------------------------------------- the scan

def test_the_scan_names_the_bad_sample_of_a_batch_and_only_of_that_batch(tiny_params,
                                                                         tiny_data, tmp_path):
    data = copy_data(tiny_data, tmp_path / "data")
    tiny_params = point_at(tiny_params, data)
    _, dataset, sampler = get_data_loader(tiny_params, tiny_params.train_data_path, True,
                                          batch_size=tiny_params.local_batch_size)
    scan = BatchScan(dataset, sampler)
    batches = [scan.indices(2, b) for b in range(len(sampler) // sampler.batch_size)]
    assert sorted(i for b in batches for i in b) == list(range(len(dataset)))  # the epoch
    sampler.set_epoch(2)
    assert [i for b in batches for i in b] == list(sampler)  # in the loader's order
    # Sample pair index 30 = 2017.h5 rows 7 (input) and 8 (target); poison row 8.
    set_value(data / "train" / "2017.h5", row=8, channel=12, value=-np.inf)
    bad_batch = next(b for b, ids in enumerate(batches) if 30 in ids)
    found, largest = scan.find(2, bad_batch)
    assert found == (f"{data / 'train' / '2017.h5'}: sample 8 of 'fields', "
                     "channel 12 (u500), has 1 inf value(s)")
    other = next(b for b, ids in enumerate(batches) if 30 not in ids and 31 not in ids)
    found, largest = scan.find(2, other)
    assert found is None and 0 < largest < 50  # normalised data: a few standard deviations
