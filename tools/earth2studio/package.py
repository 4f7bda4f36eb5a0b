"""A trained model as a package of files: everything Earth2Studio needs to run it.

    <package>/metadata.json       what the model is: its config, its channels and their
                                  Earth2Studio names, its grid (latitudes north to south,
                                  longitudes), its time step, its ensemble (members' noise)
    <package>/weights.pt          the model's full tensors, by parameter name (a
                                  checkpoint's "model": any layout's checkpoint holds them)
    <package>/global_means.npy    (1, C, 1, 1) the normalisation the model was trained with
    <package>/global_stds.npy     (1, C, 1, 1)

`export` writes it from a checkpoint (python -m tools.export_earth2studio), without
Earth2Studio; `read_package` reads it back (tools.earth2studio.prognostic.Forecaster loads
one as Earth2Studio's models load theirs). The package holds no code: it runs where this
repository's `networks/` can be imported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from data.forecast import RolloutData
from networks.factory import build_model
from tools.earth2studio.names import check_grid, earth2studio_variables
from training.checkpoint import read_checkpoint
from utils.config import saved_config
from utils.config_schema import Config
from utils.errors import CheckpointError, ConfigError

FORMAT = "era5-vit-earth2studio-package"
VERSION = 1
METADATA, WEIGHTS = "metadata.json", "weights.pt"
MEANS, STDS = "global_means.npy", "global_stds.npy"
FILES = (METADATA, WEIGHTS, MEANS, STDS)


@dataclass(frozen=True)
class ModelPackage:
    """A read package: the config, channels (ours and Earth2Studio's names), grid, step,
    normalisation (`means`, `stds`: (C,) float32) and the model's full tensors."""

    config: Config
    channels: list[str]
    variables: list[str]
    latitude: np.ndarray
    longitude: np.ndarray
    step_hours: int
    means: np.ndarray
    stds: np.ndarray
    weights: dict[str, torch.Tensor]
    metadata: dict[str, Any]

    @property
    def ensemble_size(self) -> int:
        """The members the model was trained with (1: a deterministic model)."""
        return self.config.ensemble_size

    def model(self) -> torch.nn.Module:
        """The network with the package's weights, serial, in eval mode."""
        model = build_model(self.config)
        model.load_state_dict(self.weights, strict=True)
        return model.eval()


def export(checkpoint: str, out: str) -> dict[str, Any]:
    """Write the package of `checkpoint` (its own saved config; the data and statistics it
    names, relocated by DATA_DIR as for inference) into the directory `out`; returns its
    metadata. A channel or grid Earth2Studio cannot name is refused before anything is
    written."""
    ckpt = read_checkpoint(checkpoint, None)
    if not isinstance(ckpt.get("params"), dict):
        raise CheckpointError(f"{checkpoint} holds no config to export the model with")
    cfg = saved_config(ckpt["params"], where=checkpoint)
    data = RolloutData(cfg, cfg.inf_data_path)  # its channels, grid and statistics
    channels = data.channel_names()
    variables = earth2studio_variables(channels, checkpoint)
    check_grid(data.grid.latitude, data.grid.longitude, f"{checkpoint} (grid of {data.location})")
    metadata = {
        "format": FORMAT, "version": VERSION,
        "model": cfg.model, "config": ckpt["params"],
        "channels": channels, "variables": variables,
        "latitude": data.grid.latitude.tolist(), "longitude": data.grid.longitude.tolist(),
        "step_hours": data.lead_hours(1)[1],
        "ensemble": ({"size": cfg.ensemble_size, "seed": cfg.seed,
                      "noise_channels": cfg.noise_channels}
                     if cfg.ensemble_size > 1 else None),
        "checkpoint": {"path": os.path.abspath(checkpoint), "iteration": int(ckpt["iters"])},
    }
    data.close()
    _make_dir(out)
    torch.save({name: t.float().contiguous() for name, t in ckpt["model"].items()},
               os.path.join(out, WEIGHTS))
    np.save(os.path.join(out, MEANS), np.asarray(data.means, np.float32).reshape(1, -1, 1, 1))
    np.save(os.path.join(out, STDS), np.asarray(data.stds, np.float32).reshape(1, -1, 1, 1))
    with open(os.path.join(out, METADATA), "w") as f:  # last: a package is complete with it
        json.dump(metadata, f, indent=1)
    return metadata


def _make_dir(out: str) -> None:
    """`out`, empty or a package already (replaced); anything else is refused."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"{out} exists and is not a directory: give a directory for the "
                          "package")
    if os.path.isdir(out):
        others = sorted(set(os.listdir(out)) - set(FILES))
        if others:
            raise ConfigError(f"{out} holds {others[0]} ({len(others)} files that are not a "
                              "package's): give an empty or new directory")
    os.makedirs(out, exist_ok=True)
    if os.path.exists(os.path.join(out, METADATA)):
        os.remove(os.path.join(out, METADATA))


def read_package(resolve: Callable[[str], str] | str) -> ModelPackage:
    """The package in directory `resolve`, or whose files `resolve(name)` gives as local
    paths (Earth2Studio's `Package.resolve`, which fetches remote packages)."""
    where = resolve if isinstance(resolve, str) else "the package"
    if isinstance(resolve, str):
        directory = resolve
        resolve = lambda name: os.path.join(directory, name)  # noqa: E731
    try:
        with open(resolve(METADATA)) as f:
            metadata = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{where}: no readable {METADATA} ({e}); export a package "
                              "with python -m tools.export_earth2studio") from None
    if metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
        raise CheckpointError(f"{where}: {METADATA} is not a version-{VERSION} package of "
                              "this project")
    weights = torch.load(resolve(WEIGHTS), map_location="cpu", weights_only=True)
    means, stds = (np.load(resolve(name)).astype(np.float32).reshape(-1)
                   for name in (MEANS, STDS))
    return ModelPackage(
        config=saved_config(metadata["config"], environ={}, where=where),
        channels=list(metadata["channels"]), variables=list(metadata["variables"]),
        latitude=np.asarray(metadata["latitude"], dtype=np.float64),
        longitude=np.asarray(metadata["longitude"], dtype=np.float64),
        step_hours=int(metadata["step_hours"]), means=means, stds=stds, weights=weights,
        metadata=metadata)
