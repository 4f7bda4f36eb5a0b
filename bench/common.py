"""What the benchmarks share: their config, a data set to read, and the machine they ran
on."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from data.synthetic import generate
from utils.config import DATA_PATH_KEYS, flags_given, read_config
from utils.config_schema import Config
from utils.hardware import cpu_name


def config_of(args: argparse.Namespace, config: str | None = None) -> Config:
    """The --config section (or `config`) of --yaml_config with the schema's flags given on
    the command line (a parser of `utils.config.flag_parser`) on top."""
    return read_config(args.yaml_config, config or args.config, flags=flags_given(args))


def data_paths(cfg: Config) -> dict[str, str]:
    """The config's data paths (`utils.config.DATA_PATH_KEYS`), to set on another config."""
    return {k: getattr(cfg, k) for k in DATA_PATH_KEYS}


def find_data(cfg: Config) -> tuple[Config, tempfile.TemporaryDirectory | None]:
    """`cfg` pointed at data to read: the config's (after DATA_DIR) when its training data
    and stats exist, else a small temporary synthetic set of the same grid (returned too, so
    the caller keeps it alive until the benchmark ends)."""
    stats = ("global_means_path", "global_stds_path", "time_means_path")
    if os.path.isdir(cfg.train_data_path) and \
            all(os.path.isfile(getattr(cfg, k)) for k in stats):
        return cfg, None
    tmp = tempfile.TemporaryDirectory(prefix="bench_data_")
    print(f"no data at {cfg.train_data_path}: timing a temporary synthetic data set "
          "of the same grid", flush=True)
    generate(tmp.name, img_size=tuple(cfg.img_size), samples_per_year=64, train_years=1,
             valid_years=1, test_years=1)
    root = Path(tmp.name)
    where = {"train_data_path": root / "train", "valid_data_path": root / "valid",
             "inf_data_path": root / "test",
             "time_means_path": root / "stats" / "time_means.npy",
             "global_means_path": root / "stats" / "global_means.npy",
             "global_stds_path": root / "stats" / "global_stds.npy"}
    assert set(where) == set(DATA_PATH_KEYS)
    return cfg.replace(**{k: str(v) for k, v in where.items()}), tmp


def machine_label(device: torch.device) -> str:
    """The device, its vector ISA and the settings that change CPU timings."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return (f"{cpu_name()}, {torch.get_num_threads()} torch threads, "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}, torch {torch.__version__}")


def run_each(cases: Sequence[Any], launch: Callable[[Any], dict], label: Callable[[Any], str]
             ) -> list[dict] | None:
    """`launch(case)` for every case (a multi-process run each), timing each on stderr;
    None after printing the first failure's one-line error."""
    rows = []
    for case in cases:
        start = time.time()
        try:
            rows.append(launch(case))
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return None
        print(f"  {label(case)} done in {time.time() - start:.0f} s", file=sys.stderr, flush=True)
    return rows
