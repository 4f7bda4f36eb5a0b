"""A trained model in Earth2Studio (tools/earth2studio): its deterministic and ensemble
workflows, fed by a split of our data, forecast what `inference.py --save_forecasts` saved,
at every lead, to 1e-5 relative: the ViT and the AFNO; an ensemble's members, each by its
own noise, also when Earth2Studio runs them in batches of its own; a deterministic model's
members from inference.py's perturbed initial conditions. The model is an Earth2Studio
prognostic model by its protocol, loads from a package as Earth2Studio's models do, and
every variable it names is in Earth2Studio's lexicon."""

from __future__ import annotations

import numpy as np
import pytest
from e2s_utils import (
    LEADS,
    TOLERANCE,
    evaluated,
    require_earth2studio,  # noqa: F401  (the fixture)
)

from tools.earth2studio.compare import difference_by_lead

pytestmark = [pytest.mark.earth2studio, pytest.mark.e2e,
              pytest.mark.usefixtures("require_earth2studio")]


def compare(run, data_dir, members: int = 0, batch_size: int | None = None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(Earth2Studio's forecasts, inference.py's, the relative difference by lead, the
    channels' stds) of `run`'s initial times, from Earth2Studio's workflow (ensemble with
    `members`)."""
    import xarray as xr
    from earth2studio import run as workflows
    from earth2studio.io import XarrayBackend
    from earth2studio.perturbation import Zero

    from tools.earth2studio.compare import earth2studio_forecasts, inference_forecasts
    from tools.earth2studio.prognostic import Forecaster, InitialConditionPerturbation
    from tools.earth2studio.source import SplitSource

    model = Forecaster.from_pretrained(str(run.package))
    source = SplitSource(str(data_dir / "test"))
    saved = xr.open_zarr(run.store)
    times = list(saved["time"].values)
    if members:
        start = Zero() if model.package.ensemble_size > 1 else InitialConditionPerturbation(model)
        io = workflows.ensemble(times, LEADS, members, model, source, XarrayBackend(), start,
                                batch_size=batch_size, device="cpu", verbose=False)
    else:
        io = workflows.deterministic(times, LEADS, model, source, XarrayBackend(),
                                     device="cpu", verbose=False)
    channels = model.package.channels
    ours, theirs = earth2studio_forecasts(io.root, channels), inference_forecasts(saved, channels)
    stds = model.package.stds
    worst = difference_by_lead(ours, theirs, stds)
    print(f"{run.run_dir.parent.parent.name}, {members or 'no'} members: largest relative "
          f"difference by lead {', '.join(f'{d:.1e}' for d in worst)}")  # docs quote it
    return ours, theirs, worst, stds


@pytest.mark.parametrize("config", ["tiny", "tiny_afno"])
def test_the_deterministic_workflow_forecasts_as_inference_at_every_lead(
        config, tiny_data, tmp_path_factory):
    run = evaluated(config, tiny_data, tmp_path_factory.getbasetemp() / "e2s")
    ours, theirs, worst, _ = compare(run, tiny_data)
    assert ours.shape == (2, LEADS + 1, 20, 16, 32)
    assert (worst <= TOLERANCE).all(), worst
    # Not a model that stands still: the forecast moves away from its start.
    assert np.abs(theirs[:, LEADS] - theirs[:, 0]).max() > 100 * TOLERANCE * np.abs(
        theirs).max()


def test_the_ensemble_workflow_forecasts_inferences_members_each_by_its_noise(
        tiny_data, tmp_path_factory):
    run = evaluated("tiny_ens", tiny_data, tmp_path_factory.getbasetemp() / "e2s")
    ours, theirs, worst, stds = compare(run, tiny_data, members=4, batch_size=2)
    assert ours.shape == (2, 4, LEADS + 1, 20, 16, 32)
    assert (worst <= TOLERANCE).all(), worst
    # The members differ, by far more than the tolerance, at every lead: each was matched
    # by its own noise (member, initial time and step keyed as inference.py keys them).
    others, first = theirs[:, 1:], np.broadcast_to(theirs[:, :1], theirs[:, 1:].shape)
    spread = difference_by_lead(others, first, stds)[1:]
    assert (spread > 100 * TOLERANCE).all(), spread


def test_a_deterministic_models_members_start_from_inferences_perturbed_states(
        tiny_data, tmp_path_factory):
    run = evaluated("tiny", tiny_data, tmp_path_factory.getbasetemp() / "e2s", ensemble_size=2)
    ours, theirs, worst, _ = compare(run, tiny_data, members=2)
    assert ours.shape == (2, 2, LEADS + 1, 20, 16, 32)
    assert (worst <= TOLERANCE).all(), worst
    assert np.abs(theirs[:, 0, 0] - theirs[:, 1, 0]).max() > 0  # perturbed, differently


def test_the_forecaster_is_a_prognostic_model_loaded_from_a_package(tiny_data,
                                                                     tmp_path_factory):
    import torch
    from earth2studio.lexicon.base import E2STUDIO_VOCAB
    from earth2studio.models.auto import Package
    from earth2studio.models.px import PrognosticModel

    from tools.earth2studio.names import EARTH2STUDIO_NAMES
    from tools.earth2studio.prognostic import Forecaster

    run = evaluated("tiny", tiny_data, tmp_path_factory.getbasetemp() / "e2s")
    model = Forecaster.load_model(Package(str(run.package)))
    assert isinstance(model, PrognosticModel) and model.to("cpu") is model
    coords = model.input_coords()
    assert list(coords) == ["batch", "lead_time", "variable", "lat", "lon"]
    assert coords["lat"][0] > coords["lat"][-1] and coords["lon"][0] == 0
    later = model.output_coords(coords)
    assert later["lead_time"][0] == np.timedelta64(6, "h")
    x = torch.zeros(1, 1, 20, 16, 32)
    shuffled = coords.copy()
    shuffled["variable"] = coords["variable"][::-1]
    with pytest.raises(ValueError):
        model(x, shuffled)
    with pytest.raises(NotImplementedError, match="tools.export_earth2studio"):
        Forecaster.load_default_package()
    assert set(EARTH2STUDIO_NAMES.values()) <= set(E2STUDIO_VOCAB)
