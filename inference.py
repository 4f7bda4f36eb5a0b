"""Forecast skill: roll a trained model forward for days and score it against persistence and
climatology.

    python inference.py --config=cpu_short                  # the config's newest run
    python inference.py --run_dir logs/cpu_base/1CPU/00     # the config saved in the run
    python inference.py --checkpoint logs/cpu_base/1CPU/00/checkpoints/ckpt_00001200.pt
    torchrun --nproc_per_node 2 inference.py --run_dir DIR  # initial conditions split (dp)
    torchrun --nproc_per_node 2 inference.py --run_dir DIR --tp 2   # tensor-parallel model

From N initial conditions spread evenly over the test split, the model forecasts 6 h ahead,
then again from its own forecast, --lead_steps times (20 steps = 5 days). Every channel at
every lead is scored by latitude-weighted RMSE (physical units) and ACC, next to the two
baselines: persistence (the initial state) and climatology (time_means). Checkpoints hold
full tensors, so any checkpoint (train.py or train_mp.py, any layout) evaluates serially or
with any --tp / --cp. Results go to <run dir>/forecast/: skill.csv, skill.json,
skill_vs_lead.png, rollout_<channel>.png, TensorBoard events (tensorboard/) and inference.log.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import sys
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as in train.py: shared CPUs

import numpy as np
import torch

import networks
from distributed.helpers import compute_split_shapes, shard_tensor
from distributed.layers import DistributedLayers
from utils import comm
from utils.cli import add_model_parallel_args
from utils.data.forecast import InitialCondition, RolloutData
from utils.errors import CheckpointError, ConfigError
from utils.evaluation import Normaliser
from utils.forecast_skill import (
    FORECASTS,
    HEADLINE_CHANNELS,
    Skill,
    describe_crossings,
    forecast_sums,
    format_table,
    skill_from_sums,
    write_csv,
    write_json,
)
from utils.precision import autocast
from utils.rollout import rollout
from utils.run.checkpoint import checkpoint_dir, latest_checkpoint, read_checkpoint
from utils.run.logging_utils import config_logger, log_to_file
from utils.run.main import run_main
from utils.run.run_dirs import newest_checkpointed
from utils.YParams import YParams

log = logging.getLogger("inference")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--yaml_config", default="./config/ViT.yaml", type=str)
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
    p.add_argument("--amp_mode", choices=["none", "fp16", "bf16"], default=None,
                   help="autocast precision (default: the training config's)")
    p.add_argument("--channels", nargs="+", default=[],
                   help=f"channels to print besides {', '.join(HEADLINE_CHANNELS)}")
    p.add_argument("--map_channel", default="t2m", help="channel of the rollout maps")
    p.add_argument("--out", default=None, help="output directory (default <run dir>/forecast)")
    return add_model_parallel_args(p)


# ------------------------------------------------------------------ which model, which config
def locate_checkpoint(args: argparse.Namespace, notes: list[str] | None = None) -> str:
    """--checkpoint, else the newest checkpoint of --run_dir, else of the --config's run
    (of several: the one saved last, said in `notes`, logged once the log is set up)."""
    if args.checkpoint:
        return args.checkpoint
    if args.run_dir:
        path = latest_checkpoint(args.run_dir)
        if path is None:
            raise CheckpointError(f"no checkpoint in {checkpoint_dir(args.run_dir)} (--run_dir)")
        return path
    if args.config is None:
        raise ConfigError("which model? give --run_dir RUN_DIR, --checkpoint FILE or --config NAME")
    params = YParams(args.yaml_config, args.config)
    pattern = os.path.join(params.expdir, args.config, "*", args.run_num or "*")
    runs = [r for r in sorted(glob.glob(pattern)) if latest_checkpoint(r)]
    if not runs:
        raise CheckpointError(f"no checkpoint in {pattern}/checkpoints: train the config "
                              "first (set LOG_DIR as for training), or give --run_dir/--checkpoint")
    if args.run_num and len(runs) > 1:
        raise ConfigError(f"{len(runs)} runs of {args.config} named {args.run_num}: "
                          f"{', '.join(runs)}; choose one with --run_dir")
    run = newest_checkpointed(runs)
    if len(runs) > 1 and notes is not None:
        notes.append(f"{len(runs)} runs of {args.config} have checkpoints; taking the newest, "
                     f"{run} (choose another with --run_dir or --run_num)")
    return latest_checkpoint(run)


class SavedParams(YParams):
    """The config a run saved in its checkpoint; DATA_DIR / LOG_DIR relocate its paths as
    they do for a YAML config."""

    def __init__(self, saved: dict[str, Any], environ: dict[str, str] | None = None):
        self.__dict__["_params"] = {}
        self.update(saved)
        self._apply_env(os.environ if environ is None else environ)


def run_directory(checkpoint: str) -> str:
    """<exp_dir> of <exp_dir>/checkpoints/ckpt_*.pt (else the checkpoint's own directory)."""
    parent = os.path.dirname(os.path.abspath(checkpoint))
    return os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else parent


def load_config(args: argparse.Namespace, path: str) -> tuple[Any, dict[str, Any]]:
    """(params, checkpoint): the --config section (checked against the checkpoint) or the
    config saved in the checkpoint, with the evaluation's own layout and precision."""
    params = YParams(args.yaml_config, args.config) if args.config else None
    ckpt = read_checkpoint(path, params)
    if params is None:
        if not isinstance(ckpt.get("params"), dict):
            raise ConfigError(f"{path} holds no config: give --config")
        params = SavedParams(ckpt["params"])
    # A train_mp.py run saved its tp/cp: the evaluation chooses its own (serial by default).
    params.update({"tp": args.tp or 1, "cp": args.cp or 1,
                   "amp_mode": args.amp_mode or params.get("amp_mode") or "none"})
    if args.parallel_order:
        params["parallel_order"] = args.parallel_order
    check_args(args, params)
    return params, ckpt


def positive(name: str, value: Any) -> int:
    if value is None or int(value) <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value}")
    return int(value)


def check_args(args: argparse.Namespace, params: Any) -> None:
    positive("--lead_steps", args.lead_steps)
    positive("--batch_size", args.batch_size)
    tp, cp = positive("--tp", params.tp), positive("--cp", params.cp)
    for key in ("num_heads", "embed_dim"):
        if params[key] % tp:
            raise ConfigError(f"{key} {params[key]} is not divisible by --tp {tp}")
    H, W = params.img_size
    if cp > (H // params.patch_size) * (W // params.patch_size):
        raise ConfigError(f"--cp {cp} is larger than the model's number of tokens")


# ------------------------------------------------------------------ the model
def load_model(params: Any, ckpt: dict[str, Any], path: str,
               device: torch.device) -> torch.nn.Module:
    """The model of this layout (serial, or distributed layers when tp x cp > 1) with the
    checkpoint's full tensors, each cut to this rank's shard (train_mp.py does the same)."""
    layers = DistributedLayers() if comm.get_size("tp-cp") > 1 else None  # as train_mp.py
    model = networks.build_model(params, layers=layers).to(device)
    names = [n for n, _ in model.named_parameters()]
    missing = [n for n in names if n not in ckpt["model"]]
    unexpected = [n for n in ckpt["model"] if n not in names]
    if missing or unexpected:
        raise CheckpointError(f"{path} does not fit the model: missing "
                              f"{missing[:1] or 'none'}, unexpected {unexpected[:1] or 'none'}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = shard_tensor(ckpt["model"][name], p)  # the full tensor without tp/cp
            if local.shape != p.shape:
                raise CheckpointError(f"{path}: {name} has shape {tuple(local.shape)}, the "
                                      f"model expects {tuple(p.shape)}")
            p.copy_(local)
    return model.eval()


# ------------------------------------------------------------------ rollouts and scores
def my_initial_conditions(ics: list[InitialCondition]) -> list[InitialCondition]:
    """This data-parallel rank's contiguous chunk (model-parallel ranks share one chunk)."""
    dp, rank = comm.get_size("dp"), comm.get_rank("dp")
    if len(ics) < dp:
        raise ConfigError(f"{len(ics)} initial conditions for {dp} data-parallel ranks: "
                          "raise --n_initial_conditions or launch fewer processes")
    sizes = compute_split_shapes(len(ics), dp)
    start = sum(sizes[:rank])
    return ics[start: start + sizes[rank]]


def evaluate(model: torch.nn.Module, data: RolloutData, ics: list[InitialCondition],
             lead_steps: int, batch_size: int, params: Any, norm: Normaliser,
             device: torch.device, map_channel: int) -> tuple[torch.Tensor, np.ndarray]:
    """Sums of scores over `ics` (utils.forecast_skill.forecast_sums), and the first
    rollout's (truth, forecast) of `map_channel`, normalised, (2, L+1, H, W)."""
    # Allocated outside inference mode: the all-reduce later updates it in place.
    sums = torch.zeros(len(FORECASTS), 2, lead_steps + 1, int(params.n_out_channels),
                       dtype=torch.float64, device=device)
    example = None
    for start in range(0, len(ics), batch_size):
        with torch.inference_mode():  # no autograd bookkeeping at all
            truth = data.read(ics[start: start + batch_size], lead_steps).to(device)
            with autocast(params, device):
                preds = rollout(model, truth[:, 0], lead_steps)
            forecast = torch.cat([truth[:, :1], preds], dim=1)  # lead 0: the initial state
            sums += forecast_sums(forecast, truth, norm.climatology)
            if example is None:
                example = torch.stack([truth[0, :, map_channel], forecast[0, :, map_channel]])
    return sums, example.cpu().numpy()


def report(skill: Skill, out_dir: str, table_channels: list[str], maps: np.ndarray,
           map_channel: str, metadata: dict[str, Any]) -> None:
    """Tables and crossings in the log; skill.csv, skill.json, TensorBoard scalars by lead
    time (one event directory per forecast, so TensorBoard overlays them) and figures."""
    from torch.utils.tensorboard import SummaryWriter  # here: only rank 0 needs them

    from tools.forecast_plots import rollout_maps, skill_vs_lead

    for name in dict.fromkeys(table_channels):  # in order, without repeats
        log.info(f"Forecast skill of {name}, mean over {skill.n_initial_conditions} "
                 "initial conditions:\n" + "\n".join(format_table(skill, name)))
    for name in dict.fromkeys(table_channels):
        log.info(describe_crossings(skill, name))
    write_csv(skill, os.path.join(out_dir, "skill.csv"))
    write_json(skill, os.path.join(out_dir, "skill.json"), metadata)
    for f, forecast in enumerate(FORECASTS):
        # purge_step 0: TensorBoard drops the events of an earlier evaluation in this directory
        with SummaryWriter(os.path.join(out_dir, "tensorboard", forecast), purge_step=0) as writer:
            for c, name in enumerate(skill.channels):
                for k, hours in enumerate(skill.lead_hours):
                    writer.add_scalar(f"forecast/RMSE({name})", skill.rmse[f, k, c], hours)
                    writer.add_scalar(f"forecast/ACC({name})", skill.acc[f, k, c], hours)
    fig = skill_vs_lead(skill, HEADLINE_CHANNELS,
                        f"{metadata['config']}, iteration {metadata['iteration']}: "
                        f"{skill.n_initial_conditions} initial conditions")
    fig.savefig(os.path.join(out_dir, "skill_vs_lead.png"), dpi=110)
    # The maps at 1, 3 and 5 days (those within the rollout; else its last lead).
    leads = [k for k, h in enumerate(skill.lead_hours) if h in (24, 72, 120)] \
        or [len(skill.lead_hours) - 1]
    fig = rollout_maps(maps[0, leads], maps[1, leads], [skill.lead_hours[k] for k in leads],
                       map_channel)
    fig.savefig(os.path.join(out_dir, f"rollout_{map_channel}.png"), dpi=80)
    log.info(f"Wrote skill.csv, skill.json, skill_vs_lead.png, rollout_{map_channel}.png "
             f"and tensorboard/ to {out_dir}")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # ---- checkpoint, config and initial conditions, before any process group exists: a
    # user error stops every rank alike, with one line
    notes: list[str] = []
    path = locate_checkpoint(args, notes)
    params, ckpt = load_config(args, path)
    data = RolloutData(params, params.inf_data_path)
    channels = data.channel_names()
    for name in [*args.channels, args.map_channel]:
        if name not in channels:
            raise ConfigError(f"unknown channel {name}; the data has {', '.join(channels)}")
    ics = data.pick(args.n_initial_conditions, args.lead_steps)
    out_dir = args.out or os.path.join(run_directory(path), "forecast")
    os.makedirs(out_dir, exist_ok=True)

    # ---- processes, the model, this data-parallel rank's share of the initial conditions
    env, device = comm.init_process(params.tp, params.cp, params.parallel_order)
    rank = comm.get_world_rank()
    config_logger(rank)
    if rank == 0:
        log_to_file(os.path.join(out_dir, "inference.log"))
    for note in notes:
        log.info(note)
    log.info(f"Checkpoint {path} (iteration {ckpt['iters']}, config {params.config}); "
             f"layout tp {comm.get_size('tp')} x cp {comm.get_size('cp')} x dp "
             f"{comm.get_size('dp')}; amp_mode {params.amp_mode}")
    mine = my_initial_conditions(ics)
    model = load_model(params, ckpt, path, device)
    norm = Normaliser(params, device)
    log.info(f"{len(ics)} initial conditions from {params.inf_data_path} ({len(mine)} on "
             f"this rank), {args.lead_steps} steps of {data.lead_hours(1)[1]} h each")

    # ---- roll out and score; the sums of every data-parallel rank are added up
    start = time.time()
    sums, example = evaluate(model, data, mine, args.lead_steps, args.batch_size, params, norm,
                             device, channels.index(args.map_channel))
    comm.sum_over(sums, "dp")
    seconds = time.time() - start
    log.info(f"Rolled out {len(ics)} x {args.lead_steps} steps in {seconds:.1f} s "
             f"({len(ics) * args.lead_steps / seconds:.1f} model steps/s)")
    stds = norm.stds.flatten().tolist()
    skill = skill_from_sums(sums, len(ics), stds, data.lead_hours(args.lead_steps), channels)
    data.close()

    # ---- report (rank 0): tables, crossings, CSV/JSON, TensorBoard, figures
    if rank == 0:
        c = channels.index(args.map_channel)
        maps = example * stds[c] + norm.means.flatten()[c].item()  # physical units
        metadata = {"checkpoint": os.path.abspath(path), "iteration": int(ckpt["iters"]),
                    "config": params.config, "amp_mode": params.amp_mode,
                    "layout": {g: comm.get_size(g) for g in ("tp", "cp", "dp")},
                    "data": params.inf_data_path, "seconds": seconds,
                    "initial_conditions": [ic.to_dict() for ic in ics]}
        report(skill, out_dir, [*HEADLINE_CHANNELS, *args.channels], maps,
               args.map_channel, metadata)


if __name__ == "__main__":
    run_main(main, sys.argv[1:])  # exit code 0, or 2 with one line for a user error
