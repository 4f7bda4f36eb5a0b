"""inference.py's command line: which model, how many initial conditions and lead steps,
where the results go, and the evaluation's own layout and precision (the schema's flags).

Torch-free: inference.py parses it at start-up, before torch is imported
(training/startup.py). A flag argparse cannot parse, or a bad value, is one `error:` line
per job (utils.config.FlagParser), as for the train scripts.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from data.era5_names import HEADLINE
from utils.config import DEFAULT_YAML, MODEL_PARALLEL_FLAGS, FlagParser, add_flags
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
    p.add_argument("--lead_steps", type=int, default=20, help="rollout steps (6 h each)")
    p.add_argument("--batch_size", type=int, default=8,
                   help="initial conditions rolled out together on each rank")
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
    # The evaluation's own layout (serial by default) and precision (default: the training
    # config's), as the schema declares them.
    return add_flags(p, model_parallel=True, only=(*MODEL_PARALLEL_FLAGS, "amp_mode"))


def parse_flags(argv: Sequence[str], description: str = "") -> argparse.Namespace:
    """The flags of `argv`, checked: FlagError (a flag argparse cannot parse) or
    ConfigError (a value out of range), each one line."""
    args = flag_parser(description).parse_args(list(argv))
    for name in ("lead_steps", "batch_size"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name} must be a positive integer, got {getattr(args, name)}")
    return args
