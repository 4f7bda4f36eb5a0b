"""data/forecast.py on the tiny synthetic data set (real HDF5 files): which initial
conditions a rollout starts from, and that the truth it is scored against is exactly what
the training loader serves."""

from __future__ import annotations

import logging

import h5py
import numpy as np
import pytest
import torch
from helpers import TINY_IMG_SIZE, TINY_SAMPLES_PER_YEAR

import data.grid as grid_module
from data.dataset import ERA5Dataset
from data.era5_names import CHANNEL_NAMES
from data.forecast import DEFAULT_INITIAL_CONDITIONS, RolloutData
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
    with pytest.raises(DataError, match=r"24-step rollout needs 25 consecutive samples \(a "
                                        r"year file, or consecutive years\), the longest run "
                                        r"has 24; lower --lead_steps"):
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


def test_windows_are_cropped_to_img_size_and_normalised(tiny_params, tiny_data, caplog):
    # the loaders read the first rows and columns only, and say so
    tiny_params = tiny_params.replace(img_size=[8, 16])
    with caplog.at_level(logging.WARNING):
        data = RolloutData(tiny_params, tiny_params.inf_data_path)
    assert data.grid.shape == (8, 16) and data.grid.latitude[-1] == 11.25
    if "crops the data's 16 x 32 grid" not in caplog.text:  # logged once per process
        assert grid_module._said >= {("crop", 16, 32, 8, 16)}
    ic = data.pick(1, 2)[0]
    got = data.read([ic], 2)[0].numpy()
    means = np.load(tiny_data / "stats" / "global_means.npy")[0]
    stds = np.load(tiny_data / "stats" / "global_stds.npy")[0]
    with h5py.File(ic.file, "r") as f:
        raw = f["fields"][ic.index: ic.index + 3, :, :8, :16]
    np.testing.assert_allclose(got, (raw - means) / stds, rtol=1e-6, atol=1e-6)
    data.close()


def test_a_smaller_img_size_is_a_crop_the_log_states_and_the_scores_follow(tiny_params,
                                                                          caplog):
    """Never a silent corner: the crop is logged with the latitudes it keeps, the
    Normaliser scores those rows only, with the cell areas of the data's grid."""
    from evaluation.regions import cell_areas
    from evaluation.scores import Normaliser

    grid_module._said.clear()
    cfg = tiny_params.replace(img_size=[4, 32])
    with caplog.at_level(logging.WARNING):
        norm = Normaliser(cfg, torch.device("cpu"))
    assert ("img_size 4 x 32 crops the data's 16 x 32 grid" in caplog.text
            and "first 4 rows (latitude 90.00 to 56.25)" in caplog.text)
    assert norm.regions == ["global", "northern-hemisphere"]  # the crop has no tropics
    areas = cell_areas(90 - 11.25 * np.arange(16))[:4]
    np.testing.assert_allclose(norm.weights[0].double(), areas / areas.mean(), rtol=1e-6)


def test_an_img_size_larger_than_the_data_is_a_one_line_error(tiny_params):
    with pytest.raises(DataError, match="2019.h5: fields are 16x32, smaller than img_size "
                                        "32x32"):
        RolloutData(tiny_params.replace(img_size=[32, 32]), tiny_params.inf_data_path)


def test_valid_times_come_from_the_files(data):
    ics = data.pick(2, 3)
    hours, phase, hour = data.valid_times(ics, 3)
    with h5py.File(ics[1].file, "r") as f:
        expected = f["time"][ics[1].index: ics[1].index + 4]
    np.testing.assert_array_equal(hours[1], expected)
    np.testing.assert_allclose(phase[1], (ics[1].index + np.arange(4)) / TINY_SAMPLES_PER_YEAR)
    np.testing.assert_array_equal(hour[1], expected % 24)


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
