"""Forecast skill: roll a trained model forward for days and score it against persistence and
climatology.

    python inference.py --config=cpu_short                  # the config's newest run
    python inference.py --run_dir logs/cpu_base/1CPU/00     # the config saved in the run
    python inference.py --checkpoint logs/cpu_base/1CPU/00/checkpoints/ckpt_00001200.pt
    torchrun --nproc_per_node 2 inference.py --run_dir DIR  # initial conditions split (dp)
    torchrun --nproc_per_node 2 inference.py --run_dir DIR --tp 2   # tensor-parallel model
    torchrun --nproc_per_node 2 inference.py --run_dir DIR --h_parallel_size 2  # AFNO mesh

    python inference.py --run_dir DIR --save_forecasts DIR/forecast/forecasts.zarr \
        --save_truth DIR/forecast/truth.zarr          # both stores for WeatherBench-2
    python inference.py --run_dir DIR --climatology CLIM.zarr  # WeatherBench-2's climatology
    python inference.py --run_dir DIR --init_hours 0,12     # WeatherBench-2's initial times
    python inference.py --config=cpu_ens                    # an ensemble: its 4 members
    python inference.py --run_dir DIR --ensemble_size 8     # 8 members (any checkpoint)

From N initial conditions spread evenly over the test split (at any hour, or at
--init_hours), the model forecasts 6 h ahead, then again from its own forecast, --lead_steps
times (20 steps = 5 days), a batch of initial conditions lead by lead (memory does not
grow with the leads; --batch_size by default chosen for the grid, said in the log).
Every channel (and 10 m wind speed) at every lead, globally and in three latitude bands,
is scored by WeatherBench-2's latitude-weighted RMSE (physical units) and ACC, next to
three baselines: persistence (the initial state), the seasonal and diurnal climatology and
the time mean (docs/scoring.md). Checkpoints hold full tensors, so any checkpoint (train.py or
train_mp.py, any layout) evaluates serially or in any layout (distributed/layout.py: --tp /
--cp for the ViT, an h x w mesh for the AFNO). Results go to <run dir>/forecast/:
skill.csv, skill.json, skill_vs_lead.png, rollout_<channel>.png, TensorBoard events
(tensorboard/) and inference.log; with --save_forecasts, the rollouts as a Zarr dataset in
WeatherBench-2's forecast layout (evaluation/forecast_file.py); with --save_truth, the truth
at every valid time on the forecasts' grid in its ERA5 layout (evaluation/truth_file.py);
with --climatology, ACC and the climatology baseline against WeatherBench-2's climatology
store (evaluation/wb2_climatology.py) instead of the data set's own.

An ensemble (`--ensemble_size E`, or an ensemble checkpoint) rolls out E members of every
initial condition (`evaluate_ensemble`: the checkpoint's noise-conditioned members, or a
deterministic model's from perturbed initial conditions, evaluation/ensemble_members.py) and
scores them by CRPS, ensemble-mean RMSE, spread, spread/skill and rank histograms beside the
perfect-model ensemble (a forced synthetic planet), the deterministic model (`--deterministic`,
or the deterministic checkpoint itself unperturbed), persistence and climatology
(evaluation/ensemble_evaluation.py): ensemble_skill.csv, rank_histograms.csv, crps_vs_lead.png,
spread_skill.png and rank_histograms.png beside the rest, where skill.csv's "model" is the
ensemble mean and the rollout maps show member 0. --save_forecasts writes every member
(a `realization` dimension).
"""

from __future__ import annotations

if __name__ == "__main__":
    # First of all, before torch is imported (training/startup.py): a stop signal ends the
    # run with one line; the flags are parsed and checked (a bad one: one `error:` line per
    # job); OpenMP's idle threads get their wait policy (inference reads its data in this
    # process).
    from evaluation.inference_flags import parse_flags
    from training.startup import start

    args = start(__doc__, parse=parse_flags,
                 stopped="before the evaluation finished: no scores were written")

import argparse
import glob
import logging
import os
import time
from typing import Any

import numpy as np
import torch

import networks
from data.era5_names import HEADLINE
from data.forecast import InitialCondition, RolloutData
from distributed import comm
from distributed.helpers import compute_split_shapes
from distributed.layout import Layout
from evaluation.ensemble_evaluation import EnsembleSums
from evaluation.ensemble_members import EnsembleForecast, PerfectEnsemble
from evaluation.forecast_file import create_store, write_forecasts
from evaluation.forecast_skill import (
    FORECASTS,
    forecast_sums,
    skill_from_sums,
)
from evaluation.inference_flags import (
    IC_PERTURBATION,
    batch_for_grid,
    check_deterministic,
    ensemble_size,
)
from evaluation.references import References
from evaluation.scores import Normaliser, whole_field
from evaluation.truth_file import write_truth
from training.checkpoint import (
    check_model_keys,
    latest_checkpoint,
    load_model_weights,
    read_checkpoint,
)
from training.logs import config_logger, log_to_file
from training.run_dirs import checkpoint_of_run, newest_checkpointed
from training.script_exit import run_main
from utils.config import read_config, run_config, saved_config
from utils.config_schema import Config
from utils.errors import CheckpointError, ConfigError
from utils.parallel_axes import MODEL_PARALLEL_KEYS
from utils.precision import Precision, choose_precision

log = logging.getLogger("inference")


# ------------------------------------------------------------------ which model, which config
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


def batch_size_of(given: int | None, channels: int, grid: tuple[int, int], E: int | None
                  ) -> tuple[int, str]:
    """(initial conditions rolled out together, why): --batch_size, else as many as fit
    (`batch_for_grid`), divided among an ensemble's E members."""
    if given is not None:
        return given, "--batch_size"
    return (max(1, batch_for_grid(channels, *grid) // (E or 1)),
            f"chosen for the {grid[0]} x {grid[1]} grid" + (f" and {E} members" if E else ""))


# ------------------------------------------------------------------ the model
def load_model(cfg: Config, ckpt: dict[str, Any], path: str, layout: Layout) -> torch.nn.Module:
    """The model of this layout with the checkpoint's full tensors, each cut to this rank's
    part (as a resumed training run does)."""
    model = networks.build_model(cfg, layers=layout.layers).to(layout.device)
    load_model_weights(model, ckpt["model"], layout, path)
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
             lead_steps: int, batch_size: int, layout: Layout, precision: Precision,
             norm: Normaliser, refs: References, map_channel: int,
             save: tuple[str, int] | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """Sums of scores over `ics` (evaluation.forecast_skill.forecast_sums), and the first
    rollout's (truth, forecast) of `map_channel`, normalised, (2, L+1, H, W). A batch of
    initial conditions is rolled out lead by lead: each lead's forecast is scored against
    its truth, read then, and dropped, so memory does not grow with --lead_steps. On a
    spatial mesh every rank rolls out its tile (`data` reads only it) and the sums are the
    grid's. `save` = (Zarr store, index of ics[0] in it): the forecasts are written there
    too, a few leads at a time."""
    device, tile = layout.device, layout.tile
    # Allocated outside inference mode: the all-reduce later updates it in place.
    sums = torch.zeros(len(FORECASTS), 2, len(norm.regions), lead_steps + 1,
                       len(refs.channels), dtype=torch.float64, device=device)
    refs.plan(data.valid_times(ics, lead_steps)[0])  # a climatology store's reads
    maps: list[torch.Tensor] = []
    for start in range(0, len(ics), batch_size):
        batch = ics[start: start + batch_size]
        hours, phase, hour = data.valid_times(batch, lead_steps)
        with torch.inference_mode():  # no autograd bookkeeping at all
            x0 = data.read_lead(batch, 0, tile).to(device)
            initial = refs.extend(x0).unsqueeze(1)  # persistence, at every lead
            x, pending = x0, []
            for k in range(lead_steps + 1):
                truth = x0 if k == 0 else data.read_lead(batch, k, tile).to(device)
                if k:
                    with precision.autocast():  # fp32 from step to step (networks/rollout.py)
                        x = model(x).float()
                clim = refs.climatology(phase[:, k], hour[:, k], hours[:, k])
                clim = clim.unsqueeze(1) if clim.dim() == 4 else clim
                sums[:, :, :, k:k + 1] += forecast_sums(
                    refs.extend(x).unsqueeze(1), refs.extend(truth).unsqueeze(1), clim,
                    refs.time_mean, norm.weights, tile, initial=initial)
                if start == 0:
                    maps.append(whole_field(torch.stack([truth[0, map_channel],
                                                         x[0, map_channel]]), tile))
                if save is not None:
                    save_lead(pending, x, k, lead_steps, save, start, refs, tile)
    return sums, torch.stack(maps, dim=1).cpu().numpy()


def evaluate_ensemble(model: torch.nn.Module, data: RolloutData, ics: list[InitialCondition],
                      lead_steps: int, batch_size: int, layout: Layout, precision: Precision,
                      norm: Normaliser, refs: References, map_channel: int,
                      ensemble: EnsembleForecast, scores: EnsembleSums,
                      perfect: PerfectEnsemble | None, deterministic: torch.nn.Module | None,
                      save: tuple[str, int] | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """`evaluate` for an ensemble: each batch's E members (B E forecasts) roll out lead by
    lead beside the deterministic model (if any) and the perfect-model ensemble (if any),
    and every lead is scored into `scores` (the ensemble's) and the returned sums (its
    ensemble mean's RMSE and ACC with persistence and climatology, as `evaluate`'s), with
    member 0's maps."""
    device, tile, E = layout.device, layout.tile, ensemble.size
    sums = torch.zeros(len(FORECASTS), 2, len(norm.regions), lead_steps + 1,
                       len(refs.channels), dtype=torch.float64, device=device)
    refs.plan(data.valid_times(ics, lead_steps)[0])
    maps: list[torch.Tensor] = []
    for start in range(0, len(ics), batch_size):
        batch = ics[start: start + batch_size]
        hours, phase, hour = data.valid_times(batch, lead_steps)
        keys = hours[:, 0]  # the initial times key the members' noise and the ranks' ties
        with torch.inference_mode():
            x0 = data.read_lead(batch, 0, tile).to(device)
            initial = refs.extend(x0)
            x = ensemble.start(x0, keys)  # (B E, C, H, W): member-major within a sample
            noise = ensemble.noise(keys, lead_steps, device)  # None: perturbed starts
            single = x0 if deterministic is not None else None
            best = perfect.members(batch, lead_steps, tile, device) if perfect else None
            pending = []
            for k in range(lead_steps + 1):
                truth = x0 if k == 0 else data.read_lead(batch, k, tile).to(device)
                if k:
                    with precision.autocast():  # fp32 from step to step
                        x = model(x, None if noise is None else noise[k - 1].flatten(0, 1))
                        x = x.float()
                        if single is not None:
                            single = deterministic(single).float()
                members = x.unflatten(0, (len(batch), E))
                clim = refs.climatology(phase[:, k], hour[:, k], hours[:, k])
                clim = clim[:, 0] if clim.dim() == 5 else clim  # (1, 1, C', H, W): time mean
                forecasts = {"ensemble": refs.extend(members), "persistence": initial,
                             "climatology": clim}
                if single is not None:
                    forecasts["deterministic"] = refs.extend(single)
                if best is not None:
                    forecasts["perfect_model"] = refs.extend(best[:, :, k])
                scores.add(k, refs.extend(truth), forecasts, norm.weights, keys, tile)
                sums[:, :, :, k:k + 1] += forecast_sums(
                    forecasts["ensemble"].mean(dim=1).unsqueeze(1),
                    refs.extend(truth).unsqueeze(1), clim.unsqueeze(1), refs.time_mean,
                    norm.weights, tile, initial=initial.unsqueeze(1))
                if start == 0:
                    maps.append(whole_field(torch.stack([truth[0, map_channel],
                                                         members[0, 0, map_channel]]), tile))
                if save is not None:
                    save_lead(pending, members, k, lead_steps, save, start, refs, tile)
    return sums, torch.stack(maps, dim=1).cpu().numpy()


def roll_out(args: argparse.Namespace, cfg: Config, beside: tuple[Config, dict[str, Any]] | None,
             model: torch.nn.Module, data: RolloutData, mine: list[InitialCondition],
             batch_size: int, layout: Layout, precision: Precision, norm: Normaliser,
             refs: References, E: int | None, save: tuple[str, int] | None
             ) -> tuple[torch.Tensor, np.ndarray, EnsembleSums | None]:
    """`evaluate`'s sums and maps, or an ensemble's (`evaluate_ensemble`) with its own
    scores' sums, added over the data-parallel ranks."""
    c = data.channel_names().index(args.map_channel)
    if not E:
        return (*evaluate(model, data, mine, args.lead_steps, batch_size, layout, precision,
                          norm, refs, c, save), None)
    parts = ensemble_parts(args, cfg, beside, model, data, layout, len(norm.regions),
                           len(refs.channels), E)
    sums, example = evaluate_ensemble(model, data, mine, args.lead_steps, batch_size, layout,
                                      precision, norm, refs, c, **parts, save=save)
    return sums, example, parts["scores"].sum_over("dp")


def ensemble_parts(args: argparse.Namespace, cfg: Config,
                   beside: tuple[Config, dict[str, Any]] | None, model: torch.nn.Module,
                   data: RolloutData, layout: Layout, regions: int, channels: int, E: int
                   ) -> dict[str, Any]:
    """`evaluate_ensemble`'s members, deterministic model, perfect-model ensemble and score
    sums, each said in the log."""
    ensemble = EnsembleForecast.of(E, layout.members(cfg),
                                   args.ic_perturbation or IC_PERTURBATION, cfg.seed, layout.tile)
    log.info(ensemble.describe())
    deterministic = model if cfg.ensemble_size == 1 else (
        load_model(*beside, args.deterministic, layout) if beside else None)
    log.info("Beside it, the deterministic model: " + (
        "the checkpoint's unperturbed forecast" if cfg.ensemble_size == 1 else
        args.deterministic or "none (give --deterministic CHECKPOINT)"))
    perfect = PerfectEnsemble(data, E)
    log.info(f"Perfect-model ensemble of {E}: the planet branched at each initial condition "
             "(data/perfect_ensemble.py)" if perfect.available
             else f"No perfect-model ensemble: {perfect.why}")
    return {"ensemble": ensemble, "deterministic": deterministic,
            "perfect": perfect if perfect.available else None,
            "scores": EnsembleSums(regions, args.lead_steps + 1, channels, E, layout.device)}


def leads_per_write(x: torch.Tensor, limit: int = 2**30) -> int:
    """Leads of a batch's forecasts `x` (B, C, H, W) written at a time: as many as fit in
    `limit` bytes of float32 (one at 0.25 degrees with 8 initial conditions)."""
    return max(1, limit // (x.numel() * 4))


def save_lead(pending: list[torch.Tensor], forecast: torch.Tensor, k: int, lead_steps: int,
              save: tuple[str, int], start: int, refs: References, tile) -> None:
    """Queue lead k of a batch's forecasts, (B, C, H, W) or an ensemble's (B, E, C, H, W),
    and write the queued leads (then cleared) once they fill `leads_per_write` or the
    rollout ends."""
    pending.append(forecast)
    if len(pending) == leads_per_write(forecast) or k == lead_steps:
        _save(save[0], save[1] + start, k + 1 - len(pending),
              torch.stack(pending, dim=forecast.dim() - 3), refs, tile)
        pending.clear()


def _save(path: str, start: int, lead: int, forecast: torch.Tensor, refs: References,
          tile) -> None:
    """Write leads lead .. lead + n - 1 of a batch's rollouts, (B, n, C, H, W) or an
    ensemble's (B, E, n, C, H, W) (the whole
    grid: gathered over a spatial mesh; one rank of each model-parallel group writes), into
    the forecast store, in float32."""
    fields = whole_field(forecast, tile)
    if comm.get_rank("mp") == 0:
        physical = refs.physical(fields).cpu().numpy()
        write_forecasts(path, start, physical, refs.channels[:forecast.shape[-3]], lead)


def main(args: argparse.Namespace) -> None:
    """Evaluate the model that the flags (`evaluation.inference_flags.parse_flags`) name."""
    # ---- checkpoint, config and initial conditions, before any process group exists: a
    # user error stops every rank alike, with one line
    notes: list[str] = []
    path = locate_checkpoint(args, notes)
    cfg, ckpt = load_config(args, path)
    data = RolloutData(cfg, cfg.inf_data_path)
    channels = data.channel_names()
    for name in [*args.channels, args.map_channel]:
        if name not in channels:
            raise ConfigError(f"unknown channel {name}; the data has {', '.join(channels)}")
    ics = data.pick(args.n_initial_conditions, args.lead_steps, args.init_hours)
    E, beside = ensemble_size(args, cfg), deterministic_config(args, cfg)
    out_dir = args.out or os.path.join(run_directory(path), "forecast")
    os.makedirs(out_dir, exist_ok=True)

    # ---- processes, the model, this data-parallel rank's share of the initial conditions
    layout = Layout.model_parallel(cfg)
    rank = comm.get_world_rank()
    config_logger(rank)
    if rank == 0:
        log_to_file(os.path.join(out_dir, "inference.log"))
    for note in notes:
        log.info(note)
    precision = choose_precision(cfg.amp_mode, layout.device)
    log.info(f"Checkpoint {path} (iteration {ckpt['iters']}, {describe_config(cfg)}); "
             f"{layout.describe()}; amp_mode {precision.mode}")
    mine = my_initial_conditions(ics)
    model = load_model(cfg, ckpt, path, layout)
    norm = Normaliser(cfg, layout.device)
    refs = References(cfg, norm, channels, layout.tile, store=args.climatology,
                      rh_definition=data.rh_definition)
    batch_size, why = batch_size_of(args.batch_size, len(refs.channels), norm.grid.shape, E)
    log.info(f"{len(ics)} initial conditions from {cfg.inf_data_path} ({len(mine)} on "
             f"this rank, {batch_size} at a time: {why})"
             + (f" at {', '.join(map(str, args.init_hours))} UTC" if args.init_hours else "")
             + f", {args.lead_steps} steps of {data.lead_hours(1)[1]} h each; "
             f"grid {norm.grid.describe()}; regions {', '.join(norm.regions)}; "
             f"climatology: {refs.kind}")
    save = None
    if args.save_forecasts:
        if rank == 0:
            create_store(args.save_forecasts, data.valid_times(ics, 0)[0][:, 0],
                         data.lead_hours(args.lead_steps), norm.grid, channels,
                         data.rh_definition, members=E or 0)
        comm.any_rank(False, layout.device)  # a barrier: the store exists before any write
        save = (args.save_forecasts, ics.index(mine[0]))
    if args.save_truth and rank == 0:
        n = write_truth(args.save_truth, data, data.valid_times(ics, args.lead_steps)[0],
                        norm.grid, channels)
        log.info(f"Wrote the truth at {n} valid times to {args.save_truth}")

    # ---- roll out and score; the sums of every data-parallel rank are added up
    start = time.time()
    sums, example, scores = roll_out(args, cfg, beside, model, data, mine, batch_size, layout,
                                     precision, norm, refs, E, save)
    comm.sum_over(sums, "dp")
    seconds = time.time() - start
    log.info(f"Rolled out {len(ics)} x {args.lead_steps} steps in {seconds:.1f} s "
             f"({len(ics) * args.lead_steps / seconds:.1f} model steps/s)")
    stds = norm.stds.flatten().tolist()
    skill = skill_from_sums(sums, len(ics), refs.scale.tolist(),
                            data.lead_hours(args.lead_steps), refs.channels, norm.regions,
                            refs.kind)
    data.close()

    # ---- report (rank 0): tables, crossings, CSV/JSON, TensorBoard, figures
    if rank == 0:
        c = channels.index(args.map_channel)
        maps = example * stds[c] + norm.means.flatten()[c].item()  # physical units
        metadata = {"checkpoint": os.path.abspath(path), "iteration": int(ckpt["iters"]),
                    "config": cfg.config, "amp_mode": precision.mode,
                    "layout": layout.sizes(), "data": cfg.inf_data_path, "seconds": seconds,
                    "grid": {"latitude": norm.grid.latitude.tolist(),
                             "longitude": norm.grid.longitude.tolist()},
                    "forecasts": (os.path.abspath(args.save_forecasts)
                                  if args.save_forecasts else None),
                    "truth": os.path.abspath(args.save_truth) if args.save_truth else None,
                    "initial_conditions": [ic.to_dict() for ic in ics]}
        from tools.forecast_report import report, report_ensemble  # only rank 0 draws

        ensemble = None if scores is None else scores.skill(
            len(ics), refs.scale.tolist(), data.lead_hours(args.lead_steps), refs.channels,
            norm.regions)
        report(skill, out_dir, [*HEADLINE, *args.channels], maps, args.map_channel, metadata,
               ensemble)
        if ensemble is not None:
            report_ensemble(ensemble, out_dir, args.channels, metadata)


if __name__ == "__main__":
    run_main(main, args)  # exit code 0, or 2 with one line for a user error
