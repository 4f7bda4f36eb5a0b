"""The trained model an evaluation runs (inference.py): the checkpoint its flags name
(--checkpoint, --run_dir's newest, or the --config's newest run), the config it trained
with, given the evaluation's own layout and precision, and the model of that layout with the
checkpoint's weights. Checkpoints hold full tensors, so any checkpoint loads in any layout.
"""

from __future__ import annotations

import argparse
import glob
import os
from typing import Any

import torch

import networks
from distributed.layout import Layout
from evaluation.inference_flags import check_deterministic
from training.checkpoint import (
    check_model_keys,
    latest_checkpoint,
    load_model_weights,
    read_checkpoint,
)
from training.run_dirs import checkpoint_of_run, newest_checkpointed
from utils.config import read_config, run_config, saved_config
from utils.config_schema import Config
from utils.errors import CheckpointError, ConfigError
from utils.parallel_axes import MODEL_PARALLEL_KEYS


def locate_checkpoint(args: argparse.Namespace, notes: list[str] | None = None) -> str:
    """--checkpoint, else the newest checkpoint of --run_dir, else of the --config's run
    (of several: the one saved last, said in `notes`, logged once the log is set up)."""
    if args.checkpoint:
        return args.checkpoint
    if args.run_dir:
        return checkpoint_of_run(args.run_dir)
    if args.config is None:
        raise ConfigError("which model? give --run_dir RUN_DIR, --checkpoint FILE or --config NAME")
    cfg = read_config(args.yaml_config, args.config)
    pattern = os.path.join(cfg.expdir, args.config, "*", args.run_num or "*")
    runs = [r for r in sorted(glob.glob(pattern)) if latest_checkpoint(r)]
    if not runs:
        raise CheckpointError(f"no checkpoint in {pattern}/checkpoints: train the config "
                              "first (set LOG_DIR as for training), or give --run_dir/--checkpoint",
                              every_rank=True)
    if args.run_num and len(runs) > 1:
        raise ConfigError(f"{len(runs)} runs of {args.config} named {args.run_num}: "
                          f"{', '.join(runs)}; choose one with --run_dir")
    run = newest_checkpointed(runs)
    if len(runs) > 1 and notes is not None:
        notes.append(f"{len(runs)} runs of {args.config} have checkpoints; taking the newest, "
                     f"{run} (choose another with --run_dir or --run_num)")
    return latest_checkpoint(run)


def run_directory(checkpoint: str) -> str:
    """<exp_dir> of <exp_dir>/checkpoints/ckpt_*.pt (else the checkpoint's own directory)."""
    parent = os.path.dirname(os.path.abspath(checkpoint))
    return os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else parent


def load_config(args: argparse.Namespace, path: str) -> tuple[Config, dict[str, Any]]:
    """(config, checkpoint): the --config section as the run trained with it (with its
    flags: `utils.config.run_config`), or the config saved in the checkpoint, with the
    evaluation's own layout (serial unless the flags say otherwise) and precision."""
    ckpt = read_checkpoint(path, None)
    saved = ckpt.get("params") if isinstance(ckpt.get("params"), dict) else None
    if args.config:
        cfg = run_config(args.yaml_config, args.config, saved, path)
    elif saved is None:
        raise ConfigError(f"{path} holds no config: give --config")
    else:
        cfg = saved_config(saved, where=path)
    check_model_keys(ckpt, cfg, path)
    # A train_mp.py run saved its layout: the evaluation chooses its own. The schema checks
    # that the sizes fit the model (e.g. tp divides the heads), as for training.
    own = {key: getattr(args, key) or 1 for key in MODEL_PARALLEL_KEYS}
    own["ensemble_parallel_size"] = 1  # every rank forecasts all its members
    for key in ("parallel_order", "amp_mode"):
        if getattr(args, key) is not None:
            own[key] = getattr(args, key)
    return cfg.replace(**own), ckpt


def describe_config(cfg: Config) -> str:
    """'config tiny', and the flags its run was trained with (they shape the model too)."""
    flags = ", ".join(f"--{k} {v}" for k, v in cfg.flags.items())
    return f"config {cfg.config}" + (f" with its run's flags {flags}" if flags else "")


def deterministic_config(args: argparse.Namespace, cfg: Config
                         ) -> tuple[Config, dict[str, Any]] | None:
    """(config, checkpoint) of --deterministic's model (its own saved config, this
    evaluation's layout), checked against the ensemble's `cfg`; None without the flag."""
    if not args.deterministic:
        return None
    own = argparse.Namespace(**{**vars(args), "config": None, "checkpoint": args.deterministic})
    beside = load_config(own, args.deterministic)
    check_deterministic(args.deterministic, beside, cfg)
    return beside


def load_model(cfg: Config, ckpt: dict[str, Any], path: str, layout: Layout) -> torch.nn.Module:
    """The model of this layout with the checkpoint's full tensors, each cut to this rank's
    part (as a resumed training run does)."""
    model = networks.build_model(cfg, layers=layout.layers).to(layout.device)
    load_model_weights(dict(model.named_parameters()), ckpt["model"], layout, path)
    return model.eval()
