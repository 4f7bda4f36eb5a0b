"""utils/forecast_data.py on the tiny synthetic data set (real HDF5 files): which initial
conditions a rollout starts from, and that the truth it is scored against is exactly what
the training loader serves."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from helpers import TINY_IMG_SIZE, TINY_SAMPLES_PER_YEAR

from utils.data.dataset import ERA5Dataset
from utils.data.forecast import DEFAULT_INITIAL_CONDITIONS, RolloutData
from utils.data.synthetic import CHANNEL_NAMES
from utils.errors import DataError


@pytest.fixture
def data(tiny_params):
    d = RolloutData(tiny_params, tiny_params.inf_data_path)
    yield d
    d.close()


def test_initial_conditions_are_spread_evenly_and_leave_room_for_the_rollout(data):
    lead = 4
    ics = data.pick(5, lead)
    last = TINY_SAMPLES_PER_YEAR - 1 - lead  # the last start whose rollout fits: 19
    assert [ic.index for ic in ics] == [0, 5, 10, 14, 19]
    assert ics[-1].index == last
    assert {ic.file for ic in ics} == set(data.files)


def test_every_candidate_is_taken_when_asked_for_all(data):
    ics = data.pick(TINY_SAMPLES_PER_YEAR - 6, 6)
    assert [ic.index for ic in ics] == list(range(TINY_SAMPLES_PER_YEAR - 6))


def test_the_default_number_is_capped_by_what_the_split_holds(data):
    assert len(data.pick(None, 20)) == TINY_SAMPLES_PER_YEAR - 20 < DEFAULT_INITIAL_CONDITIONS


def test_a_rollout_longer_than_the_year_is_a_one_line_data_error(data):
    with pytest.raises(DataError, match=r"24-step rollout needs 25 consecutive samples in one "
                                        r"year file, the longest has 24; lower --lead_steps"):
        data.pick(None, 24)


def test_more_initial_conditions_than_fit_is_a_one_line_data_error(data):
    with pytest.raises(DataError, match=r"--n_initial_conditions 21: .* has 20 initial "
                                        r"conditions with room for 4 steps"):
        data.pick(21, 4)
    with pytest.raises(DataError, match="--lead_steps must be at least 1"):
        data.pick(3, 0)


def test_windows_are_the_training_loaders_samples_in_a_row(tiny_params, data):
    """Window 0 of an initial condition at sample i is the loader's input of sample i, and
    window k its target of sample i + k - 1 (the pair t, t + 6 h)."""
    tiny_params = tiny_params.replace(limit_nsamples_val=None)
    loader_data = ERA5Dataset(tiny_params, tiny_params.inf_data_path, train=False)
    ics = data.pick(3, 4)
    windows = data.read(ics, 4)
    assert windows.shape == (3, 5, 20, *TINY_IMG_SIZE) and windows.dtype == torch.float32
    for b, ic in enumerate(ics):
        torch.testing.assert_close(windows[b, 0], loader_data[ic.index][0], rtol=0, atol=0)
        for k in range(1, 5):
            _, tar = loader_data[ic.index + k - 1]
            torch.testing.assert_close(windows[b, k], tar, rtol=0, atol=0)


def test_windows_are_cropped_to_img_size_and_normalised(tiny_params, tiny_data):
    # the loaders read the first rows and columns only
    tiny_params = tiny_params.replace(img_size=[8, 16])
    data = RolloutData(tiny_params, tiny_params.inf_data_path)
    ic = data.pick(1, 2)[0]
    got = data.read([ic], 2)[0].numpy()
    means = np.load(tiny_data / "stats" / "global_means.npy")[0]
    stds = np.load(tiny_data / "stats" / "global_stds.npy")[0]
    with h5py.File(ic.file, "r") as f:
        raw = f["fields"][ic.index: ic.index + 3, :, :8, :16]
    np.testing.assert_allclose(got, (raw - means) / stds, rtol=1e-6, atol=1e-6)
    data.close()


def test_lead_times_follow_dt(tiny_params):
    tiny_params = tiny_params.replace(dt=2)
    data = RolloutData(tiny_params, tiny_params.inf_data_path)
    assert data.lead_hours(3) == [0, 12, 24, 36]
    ic = data.pick(1, 3)[0]
    assert data.read([ic], 3).shape[1] == 4
    assert data.pick(None, 11)[-1].index == TINY_SAMPLES_PER_YEAR - 1 - 22
    data.close()


def test_channel_names_come_from_the_files(data):
    assert data.channel_names() == list(CHANNEL_NAMES)
