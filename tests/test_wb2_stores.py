"""Forecasts, truth and climatology in WeatherBench-2's layouts, on every grid the
preparation makes (evaluation/forecast_file.py, evaluation/truth_file.py,
evaluation/wb2_climatology.py, data/forecast.py), on small stores made here:

  - WeatherBench-2's rule (tests/era5_stores.py: `wb2_rule`), as its
    `evaluation.open_source_files` and `_impose_data_selection` apply it: latitude made
    increasing in both stores, the forecast's latitude and longitude equal to the truth's
    to 1e-3 *before* any selection, then the levels asked for present. It holds for
    forecasts against the truth store `--save_truth` writes, on the native grid (ascending
    without poles, or with poles), a crop and block means; on a native grid the source
    store itself serves as the truth;
  - rollouts from the last days of a test year read their truth from the next one;
  - WeatherBench-2's climatology store (dayofyear x hour) gives ACC's reference at each
    valid time's day of year and hour, on the grid or a crop of it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from era5_stores import VARIABLES, clim_known, grid, wb2_climatology, wb2_rule, wb2_zarr
from helpers import CONFIG_FILE

from data.era5_names import CHANNEL_NAMES
from data.forecast import RolloutData
from data.grid import Grid
from era5 import prepare as era5_prepare
from evaluation.forecast_file import create_store, write_forecasts
from evaluation.inference_flags import batch_for_grid
from evaluation.references import References
from evaluation.scores import Normaliser
from evaluation.truth_file import write_truth
from evaluation.wb2_climatology import StoreClimatology, day_and_hour
from utils.config import read_config
from utils.errors import DataError
from utils.tile import Tile

LEAD = 3


def config(out, shape):
    return read_config(CONFIG_FILE, "tiny", environ={"DATA_DIR": str(out)}).replace(
        img_size=list(shape), patch_size=1)  # no model here: any grid


GRIDS = {  # name: (store options, preparation flags, grid prepared)
    "native, ascending without poles": (dict(rows=8, cols=16, coarse=True), [], (8, 16)),
    "native, with poles": (dict(rows=9, cols=16), [], (9, 16)),
    "crop": (dict(rows=9, cols=16), ["--crop_rows", "8"], (8, 16)),
    "coarsen": (dict(rows=9, cols=16), ["--crop_rows", "8", "--coarsen", "2"], (4, 8)),
}


@pytest.fixture(scope="module", params=list(GRIDS))
def saved(request, tmp_path_factory):
    """(grid option, source store, forecast store, truth store): the forecasts are the
    truth itself (so every valid time can be compared), written as inference.py does."""
    import xarray as xr

    options, flags, shape = GRIDS[request.param]
    root = tmp_path_factory.mktemp("grids")
    source = wb2_zarr(root / "source.zarr", [2017, 2018], days=3, **options)
    era5_prepare.main([str(source), str(root / "out"), "--train_years", "2017",
                       "--test_years", "2018", "--max_samples", "12", *flags])
    cfg = config(root / "out", shape)
    data = RolloutData(cfg, cfg.inf_data_path)
    ics = data.pick(4, LEAD)
    hours = data.valid_times(ics, LEAD)[0]
    norm = Normaliser(cfg, torch.device("cpu"))
    physical = data.read(ics, LEAD) * norm.stds.view(1, 1, -1, 1, 1) + norm.means.view(
        1, 1, -1, 1, 1)
    channels = data.channel_names()
    create_store(str(root / "forecasts.zarr"), hours[:, 0], data.lead_hours(LEAD), norm.grid,
                 channels)
    write_forecasts(str(root / "forecasts.zarr"), 0, physical.numpy(), channels)
    assert write_truth(str(root / "truth.zarr"), data, hours, norm.grid, channels) == \
        len(np.unique(hours))
    data.close()
    return (request.param, xr.open_zarr(source), xr.open_zarr(root / "forecasts.zarr"),
            xr.open_zarr(root / "truth.zarr"))


def test_every_grid_is_scored_by_weatherbench2s_rule_against_the_truth_store(saved):
    option, _, forecasts, truth = saved
    forecasts, truth = wb2_rule(forecasts, truth)
    for k, lead in enumerate(forecasts.prediction_timedelta.values):
        valid = forecasts.time.values + lead
        for name in VARIABLES:  # the forecasts are the truth (normalised and back, float32)
            np.testing.assert_allclose(
                forecasts[name].isel(prediction_timedelta=k).values,
                truth[name].sel(time=valid).values, rtol=1e-5, atol=1e-4,
                err_msg=f"{option}: {name} +{k}")
    assert truth["relative_humidity"].attrs["units"] == "1"
    assert 0.1 < float(truth["relative_humidity"].mean()) < 1  # a fraction, as WB2's
    assert truth["geopotential"].attrs["units"] == "m**2 s**-2"
    with pytest.raises(KeyError):  # WeatherBench-2's default levels: 700 hPa is not there
        wb2_rule(*saved[2:], levels=[500, 700, 850])


def test_on_the_native_grid_the_source_store_serves_as_the_truth(saved):
    option, source, forecasts, truth = saved
    if not option.startswith("native"):
        with pytest.raises(AssertionError):  # a crop or block means: another grid
            wb2_rule(forecasts, source)
        return
    forecasts, source = wb2_rule(forecasts, source)
    _, truth = wb2_rule(forecasts, truth)
    for name in VARIABLES:
        np.testing.assert_allclose(truth[name].values,
                                   source[name].sel(time=truth.time).transpose(
                                       *truth[name].dims).values, rtol=1e-6)


def test_a_rollout_from_late_december_reads_its_truth_from_the_next_year(tmp_path):
    source = wb2_zarr(tmp_path / "wb2.zarr", [2015, 2016, 2017], rows=3, cols=4,
                      chunk_time=1464)
    out = tmp_path / "out"
    era5_prepare.main([str(source), str(out), "--train_years", "2015", "--test_years",
                       "2016-2017", "--batch_size", "512"])
    cfg = config(out, (3, 4))
    data = RolloutData(cfg, cfg.inf_data_path)
    lead = 8
    ics = data.candidates(lead)
    assert len(ics) == 1464 + 1460 - lead  # 2016 to its last sample; 2017 up to its end
    last = [ic for ic in ics if ic.file.endswith("2016.h5")][-1]
    assert last.index == 1463  # 2016-12-31T18
    hours = data.valid_times([last], lead)[0][0]
    assert (np.diff(hours) == 6).all()
    start = np.datetime64("1970-01-01T00", "h") + int(hours[0]) * np.timedelta64(1, "h")
    assert start == np.datetime64("2016-12-31T18", "h")
    window = data.read([last], lead)[0]
    physical = data.read_at(hours)
    means, stds = data.means, data.stds
    np.testing.assert_allclose(window.numpy(), (physical - means) / stds, rtol=1e-6,
                               atol=1e-6)
    assert ics[-1].file.endswith("2017.h5") and ics[-1].index == 1460 - lead - 1
    data.close()


# ------------------------------------------------------------------ climatology store
@pytest.fixture(scope="module")
def prepared_with_poles(tmp_path_factory):
    root = tmp_path_factory.mktemp("clim")
    source = wb2_zarr(root / "source.zarr", [2017, 2018], rows=9, cols=16, days=3)
    era5_prepare.main([str(source), str(root / "out"), "--train_years", "2017",
                       "--test_years", "2018", "--max_samples", "12", "--crop_rows", "8"])
    lat, lon = grid(9, 16)
    return root, wb2_climatology(root / "clim.zarr", lat[::-1].copy(), lon)  # ascending


def test_weatherbench2s_climatology_store_is_the_anomaly_reference(prepared_with_poles):
    """At each valid time: the entry of its day of year and hour, on the data's grid (a
    crop of the store's), relative humidity in percent, in the scores' units."""
    root, store = prepared_with_poles
    cfg = config(root / "out", (8, 16))
    norm = Normaliser(cfg, torch.device("cpu"))
    data = RolloutData(cfg, cfg.inf_data_path)
    channels = data.channel_names()
    refs = References(cfg, norm, channels, Tile.whole((8, 16)), store=str(store))
    assert refs.channels == [*CHANNEL_NAMES, "ws10"] and "day of year x hour" in refs.kind
    ics = data.pick(2, LEAD)
    hours, phase, hour = data.valid_times(ics, LEAD)
    got = refs.climatology(phase, hour, hours).double()
    day, hh = day_and_hour(hours)
    assert day[0, 0] == 1 and list(hh[0]) == [0, 6, 12, 18][:LEAD + 1]
    lat, lon = norm.grid.latitude, norm.grid.longitude
    for c, name in enumerate(refs.channels):
        physical = clim_known(name, day, hh, lat, lon).astype(np.float64)
        scored = (physical - refs.offset[c].item()) / refs.scale[c].item()
        np.testing.assert_allclose(got[:, :, c].numpy(), scored, rtol=1e-4, atol=1e-4,
                                   err_msg=name)
    data.close()


def test_a_climatology_store_on_another_grid_is_refused_in_one_line(prepared_with_poles,
                                                                    tmp_path):
    root, _ = prepared_with_poles
    lat, lon = grid(9, 16)
    coarse = wb2_climatology(tmp_path / "coarse.zarr", lat[::2].copy(), lon[::2].copy())
    cfg = config(root / "out", (8, 16))
    norm = Normaliser(cfg, torch.device("cpu"))
    with pytest.raises(DataError, match=r"coarse.zarr: its latitude \(5 values, -90 .. 90\) "
                                        r"has no 67.5, a latitude of the grid scored"):
        References(cfg, norm, list(CHANNEL_NAMES), Tile.whole((8, 16)), store=str(coarse))


# ------------------------------------------------------------------ reading the store at size
def valid_hours(starts: list[str], leads: int) -> np.ndarray:
    """(len(starts), leads + 1) valid times, hours since 1970, 6 h apart."""
    first = [np.datetime64(s, "h") - np.datetime64("1970-01-01T00", "h") for s in starts]
    return np.array([[int(f / np.timedelta64(1, "h")) + 6 * k for k in range(leads + 1)]
                     for f in first])


def expected_climatology(channels, hours, lat, lon) -> np.ndarray:
    day, hh = day_and_hour(hours)
    return np.stack([clim_known(c, day, hh, lat, lon) for c in channels], axis=-3)


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    """A climatology store in the 0.25-degree store's chunks (3 days x 3 hours x one
    level; ~2,700 chunk files) of five channels (four variables, and 10 m wind speed)."""
    lat, lon = grid(9, 16)
    return wb2_climatology(tmp_path_factory.mktemp("chunked") / "clim.zarr", lat, lon,
                           chunked=True, channels=CHUNKED)


CHUNKED = ("z500", "t850", "t2m", "r850")


def test_the_store_is_read_a_chunk_at_a_time_each_chunk_once(chunked):
    """Asked for the valid times of two rollouts lead by lead, each (variable, chunk of
    days x hours) is read once and every value is the store's."""
    lat, lon = grid(9, 16)
    store = chunked
    channels = [*CHUNKED, "ws10"]
    clim = StoreClimatology(str(store), channels, Grid(lat[:8], lon))
    hours = valid_hours(["2018-01-01T00", "2018-03-01T12"], 4)
    clim.plan(hours)
    for k in range(hours.shape[1]):  # as inference.py asks: every rollout at one lead
        np.testing.assert_allclose(clim.at(hours[:, k]),
                                   expected_climatology(channels, hours[:, k], lat[:8], lon),
                                   rtol=1e-6)
    day, hh = day_and_hour(hours.ravel())
    chunks = {((d - 1) // 3, (h // 6) // 3) for d, h in zip(day, hh, strict=True)}
    assert clim.reads == len(chunks) * 5  # 5 variables, each chunk once
    assert clim.planes_read == len(set(zip(day, hh, strict=True)))
    assert clim.cached_bytes() == 0  # every plane dropped after its last use


def test_a_small_cache_reads_again_and_gives_the_same_values(chunked):
    lat, lon = grid(9, 16)
    store = chunked
    channels = ["z500", "t2m", "r850"]
    plane = len(channels) * 8 * 16 * 4
    clim = StoreClimatology(str(store), channels, Grid(lat[:8], lon), cache_bytes=2 * plane)
    hours = valid_hours(["2018-06-30T18", "2018-07-01T00"], 6).ravel()  # no plan
    for h in hours:
        np.testing.assert_allclose(clim.at(h[None])[0],
                                   expected_climatology(channels, h, lat[:8], lon), rtol=1e-6)
        assert clim.cached_bytes() <= 2 * plane


def test_relative_humidity_without_units_is_told_a_fraction_by_its_range(tmp_path):
    lat, lon = grid(9, 16)
    store = wb2_climatology(tmp_path / "clim.zarr", lat, lon, rh_units=None)
    clim = StoreClimatology(str(store), ["r500"], Grid(lat[:8], lon))
    hours = valid_hours(["2018-02-01T06"], 0)[0]
    np.testing.assert_allclose(clim.at(hours)[0], expected_climatology(
        ["r500"], hours[0], lat[:8], lon), rtol=1e-6)  # percent, from a fraction
    assert clim.rh_definition == "wb2"


def test_the_store_at_a_gs_url_is_read_anonymously(monkeypatch):
    """As the data: gcsfs would otherwise try (stale) credentials first."""
    import xarray as xr

    seen = {}

    def open_dataset(path, **kwargs):
        seen.update(kwargs)
        raise FileNotFoundError("no such bucket")

    monkeypatch.setattr(xr, "open_dataset", open_dataset)
    with pytest.raises(DataError, match="--climatology gs://weatherbench2/x.zarr: not a Zarr"):
        StoreClimatology("gs://weatherbench2/x.zarr", ["t2m"], Grid(np.zeros(1), np.zeros(1)))
    assert seen["storage_options"] == {"token": "anon"}


def test_a_climatology_of_the_other_humidity_definition_is_refused(tmp_path):
    """Data prepared with ECMWF's relative humidity against WeatherBench-2's climatology
    store (its own, over water): one line, naming both and what to do."""
    source = wb2_zarr(tmp_path / "source.zarr", [2017, 2018], rows=9, cols=16, days=3,
                      with_q=True)
    era5_prepare.main([str(source), str(tmp_path / "out"), "--train_years", "2017",
                       "--test_years", "2018", "--max_samples", "12", "--crop_rows", "8",
                       "--rh_definition", "ecmwf"])
    lat, lon = grid(9, 16)
    store = wb2_climatology(tmp_path / "clim.zarr", lat, lon)
    cfg = config(tmp_path / "out", (8, 16))
    data = RolloutData(cfg, cfg.inf_data_path)
    assert data.rh_definition == "ecmwf"
    norm = Normaliser(cfg, torch.device("cpu"))
    References(cfg, norm, data.channel_names(), Tile.whole((8, 16)),  # its own: the same
               rh_definition=data.rh_definition)
    with pytest.raises(DataError, match=r"r500, r850: the data's test split holds ECMWF's "
                                        r"\(IFS, mixed phase\) relative humidity, the "
                                        r"climatology store .*clim.zarr WeatherBench-2's .* "
                                        r"prepare the data with --rh_definition wb2") as error:
        References(cfg, norm, data.channel_names(), Tile.whole((8, 16)), store=str(store),
                   rh_definition=data.rh_definition)
    assert "\n" not in str(error.value)
    data.close()


def test_initial_conditions_at_the_hours_asked_for_and_a_lead_read_alone(
        prepared_with_poles):
    root, _ = prepared_with_poles
    cfg = config(root / "out", (8, 16))
    data = RolloutData(cfg, cfg.inf_data_path)
    ics = data.pick(4, LEAD, hours=[0, 12])
    hours = data.valid_times(ics, LEAD)[0]
    assert sorted(set(hours[:, 0] % 24)) == [0, 12] and len(ics) == 4
    window = data.read(ics, LEAD)
    for k in range(LEAD + 1):  # a lead read alone is the window's, bit for bit
        assert torch.equal(data.read_lead(ics, k), window[:, k])
    with pytest.raises(DataError, match=r"--init_hours 3: .* has no initial condition at "
                                        r"those hours of the day \(its samples are at 0, 6, "
                                        r"12, 18 UTC\)"):
        data.pick(4, LEAD, hours=[3])
    data.close()


@pytest.mark.parametrize("shape, batch", [((720, 1440), 2), ((721, 1440), 2),
                                          ((360, 720), 8), ((32, 64), 8)])
def test_the_default_batch_is_chosen_for_the_grid(shape, batch):
    assert batch_for_grid(21, *shape) == batch


# ------------------------------------------------------------------ crops and weights
def wb2_lat_weights(latitude: np.ndarray) -> np.ndarray:
    """WeatherBench-2's `get_lat_weights` on the latitudes it is given (ascending), written
    out: cells to the midpoints, the first and last reaching the poles, mean 1."""
    lat = np.deg2rad(np.sort(latitude))
    bounds = np.concatenate([[-np.pi / 2], (lat[:-1] + lat[1:]) / 2, [np.pi / 2]])
    w = np.sin(bounds[1:]) - np.sin(bounds[:-1])
    return (w / w.mean())[::-1]  # north to south, as the data


def test_crops_are_weighted_as_scoring_md_says():
    """A prepared crop (the grid itself) is weighted as WeatherBench-2 weighs it; an
    img_size crop keeps the whole grid's cell areas: one row off changes ~nothing, a
    hemisphere gives WeatherBench-2's edge row half of the weight."""
    from evaluation.regions import latitude_weights

    lat720 = 90.0 - 0.25 * np.arange(720)
    lon = 0.25 * np.arange(1440)
    np.testing.assert_allclose(latitude_weights(Grid(lat720, lon)), wb2_lat_weights(lat720),
                               rtol=1e-12)  # --crop_rows 720: the grid itself
    one_row = Grid(np.append(lat720, -90.0), lon).crop(720, 1440)
    ours, theirs = latitude_weights(one_row), wb2_lat_weights(lat720)
    assert ours[-1] == pytest.approx(0.00685, rel=1e-3)
    assert theirs[-1] == pytest.approx(0.00771, rel=1e-3)
    np.testing.assert_allclose(ours[:-1], theirs[:-1], rtol=2e-6)
    half = Grid(lat720, lon).crop(360, 1440)
    ours, theirs = latitude_weights(half), wb2_lat_weights(half.latitude)
    assert ours[-1] / ours.sum() == pytest.approx(0.00437, rel=1e-2)
    assert theirs[-1] / theirs.sum() == pytest.approx(0.503, rel=1e-2)
