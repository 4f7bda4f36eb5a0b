"""inference.py's command line: which model, how many initial conditions and lead steps,
where the results go, and the evaluation's own layout and precision (the schema's flags).

Torch-free: inference.py parses it at start-up, before torch is imported
(training/startup.py). A flag argparse cannot parse, or a bad value, is one `error:` line
per job (utils.config.FlagParser), as for the train scripts.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from data.era5_names import HEADLINE
from utils.config import DEFAULT_YAML, MODEL_PARALLEL_FLAGS, FlagParser, add_flags
from utils.config_schema import Config
from utils.errors import ConfigError


def flag_parser(description: str = "") -> FlagParser:
    p = FlagParser(description=description)
    p.add_argument("--yaml_config", default=DEFAULT_YAML, help="the YAML config file")
    p.add_argument("--config", default=None,
                   help="config section (default: the config saved in the checkpoint)")
    p.add_argument("--run_num", default=None,
                   help="with --config: which run of it (default: the one whose newest "
                        "checkpoint was written last)")
    p.add_argument("--run_dir", default=None, help="run directory: its newest checkpoint")
    p.add_argument("--checkpoint", default=None, help="a checkpoint file")
    p.add_argument("--n_initial_conditions", type=int, default=None,
                   help="spread evenly over the test split (default 32, or all if fewer)")
    p.add_argument("--init_hours", type=hours_of_day, default=None, metavar="H,H",
                   help="only initial conditions at these UTC hours, e.g. 0,12 as "
                        "WeatherBench-2's baselines (default: any hour)")
    p.add_argument("--lead_steps", type=int, default=20, help="rollout steps (6 h each)")
    p.add_argument("--batch_size", type=int, default=None,
                   help="initial conditions rolled out together on each rank (default: "
                        "chosen for the grid, at most 8: 2 at 0.25 degrees)")
    p.add_argument("--channels", nargs="+", default=[],
                   help=f"channels to print besides {', '.join(HEADLINE)}")
    p.add_argument("--map_channel", default="t2m", help="channel of the rollout maps")
    p.add_argument("--out", default=None, help="output directory (default <run dir>/forecast)")
    p.add_argument("--save_forecasts", default=None, metavar="PATH",
                   help="also write the rollouts (physical units) to this Zarr store in "
                        "WeatherBench-2's forecast layout")
    p.add_argument("--save_truth", default=None, metavar="PATH",
                   help="also write the truth at every valid time of the rollouts, on their "
                        "grid, to this Zarr store in WeatherBench-2's ERA5 layout")
    p.add_argument("--climatology", default=None, metavar="PATH",
                   help="WeatherBench-2's climatology store (dayofyear x hour) for ACC and "
                        "the climatology baseline (default: the data set's own)")
    p.add_argument("--ensemble_size", type=int, default=None, metavar="E",
                   help="score an ensemble of E >= 2 members per initial condition (CRPS, "
                        "spread, spread/skill, rank histograms; evaluation/ensemble_members.py); "
                        "default: the checkpoint's ensemble_size (a deterministic checkpoint: "
                        "no ensemble)")
    p.add_argument("--ic_perturbation", type=float, default=None, metavar="SIGMA",
                   help="a deterministic checkpoint's ensemble: members start from x0 + SIGMA "
                        f"x N(0, 1), normalised units (default {IC_PERTURBATION})")
    p.add_argument("--deterministic", default=None, metavar="CHECKPOINT",
                   help="with an ensemble checkpoint: a deterministic model's checkpoint "
                        "(same data) rolled out beside it, its CRPS (= MAE) in the tables")
    # The evaluation's own layout (serial by default) and precision (default: the training
    # config's), as the schema declares them.
    return add_flags(p, model_parallel=True, only=(*MODEL_PARALLEL_FLAGS, "amp_mode"))


def hours_of_day(text: str) -> list[int]:
    """'0,12' -> [0, 12]: hours of the day, 0 .. 23."""
    try:
        hours = sorted({int(h) for h in text.split(",") if h.strip()})
    except ValueError:
        hours = []
    if not hours or not all(0 <= h <= 23 for h in hours):
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of hours 0 .. 23, e.g. 0,12")
    return hours


# Bytes of scored fields (C' x H x W float32) one initial condition holds while its rollout
# is scored: the lead's forecast, truth, initial state and climatology with their derived
# channels and the scores' temporaries (~12), and the climatology store's planes kept
# between chunk reads (up to 12 at 0.25 degrees). docs/real_era5.md has the peaks measured.
FIELDS_PER_INITIAL_CONDITION = 24
BATCH_BYTES = 4 * 2**30
MAX_BATCH = 8
# A deterministic checkpoint's ensemble: the perturbation of its initial conditions (in
# units of each channel's std), and the largest ensemble evaluated (its CRPS needs E^2 pairs
# at every point).
IC_PERTURBATION = 0.05
MAX_ENSEMBLE = 64


def batch_for_grid(channels: int, H: int, W: int) -> int:
    """The default --batch_size: as many initial conditions as fit in BATCH_BYTES, 1 .. 8
    (8 on the tutorial's grids up to 0.5 degrees, 2 at 0.25)."""
    per = FIELDS_PER_INITIAL_CONDITION * channels * H * W * 4
    return max(1, min(MAX_BATCH, BATCH_BYTES // per))


def parse_flags(argv: Sequence[str], description: str = "") -> argparse.Namespace:
    """The flags of `argv`, checked: FlagError (a flag argparse cannot parse) or
    ConfigError (a value out of range), each one line."""
    args = flag_parser(description).parse_args(list(argv))
    for name in ("lead_steps", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ConfigError(f"--{name} must be a positive integer, got {getattr(args, name)}")
    E = args.ensemble_size
    if E is not None and not 2 <= E <= MAX_ENSEMBLE:
        raise ConfigError(f"--ensemble_size {E}: an ensemble is scored with 2 to {MAX_ENSEMBLE} "
                          "members (one member has no spread, rank or CRPS of its own: leave "
                          "the flag out for the deterministic scores)")
    if args.ic_perturbation is not None and not args.ic_perturbation > 0:
        raise ConfigError(f"--ic_perturbation {args.ic_perturbation}: a positive perturbation "
                          "of a deterministic model's initial conditions expected")
    return args


def ensemble_size(args: argparse.Namespace, cfg: Config) -> int | None:
    """Members to evaluate: --ensemble_size, else an ensemble checkpoint's own; None: the
    deterministic evaluation. ConfigError for flags that do not fit the checkpoint."""
    if cfg.ensemble_size > 1 and args.ic_perturbation is not None:
        raise ConfigError(f"--ic_perturbation: {cfg.config} is an ensemble of "
                          f"{cfg.ensemble_size}, whose members differ by their own noise; "
                          "perturbed initial conditions are for a deterministic checkpoint")
    if cfg.ensemble_size == 1 and args.ic_perturbation is not None and not args.ensemble_size:
        raise ConfigError(f"--ic_perturbation {args.ic_perturbation}: {cfg.config} is "
                          "deterministic; its members start from perturbed initial conditions "
                          "when --ensemble_size E asks for an ensemble")
    if cfg.ensemble_size == 1 and args.deterministic:
        raise ConfigError(f"--deterministic {args.deterministic}: the checkpoint evaluated is "
                          "deterministic itself (its unperturbed forecast is scored beside "
                          "its ensemble); --deterministic is for an ensemble checkpoint")
    return args.ensemble_size or (cfg.ensemble_size if cfg.ensemble_size > 1 else None)


def check_deterministic(path: str | None, beside: tuple[Config, dict[str, Any]] | None,
                        cfg: Config) -> None:
    """--deterministic's checkpoint: a deterministic model of the evaluated one's data."""
    if beside is None:
        return
    other = beside[0]
    if other.ensemble_size > 1:
        raise ConfigError(f"--deterministic {path}: an ensemble of {other.ensemble_size} "
                          "(ensemble_size > 1); give a deterministic model's checkpoint")
    if (tuple(other.img_size), other.n_in_channels) != (tuple(cfg.img_size), cfg.n_in_channels):
        raise ConfigError(f"--deterministic {path}: a model of {other.n_in_channels} channels "
                          f"on {other.img_size}, the ensemble's is of {cfg.n_in_channels} on "
                          f"{cfg.img_size}")
