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

`main` below is the whole evaluation. Its flags are evaluation/inference_flags.py's (parsed
before torch is imported); the checkpoint, its config and its model, training/trained_model.py's;
the rollouts and their scores (`evaluate`, `evaluate_ensemble`), evaluation/forecast_loop.py's.
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
import logging
import os
import time

from data.era5_names import HEADLINE
from data.forecast import RolloutData
from distributed import comm
from distributed.layout import Layout
from evaluation.forecast_file import create_store
from evaluation.forecast_loop import batch_size_of, my_initial_conditions, roll_out
from evaluation.forecast_skill import skill_from_sums
from evaluation.inference_flags import ensemble_size
from evaluation.references import References
from evaluation.scores import Normaliser
from evaluation.truth_file import write_truth
from training.logs import config_logger, log_to_file
from training.script_exit import run_main
from training.trained_model import (
    describe_config,
    deterministic_config,
    load_config,
    load_model,
    locate_checkpoint,
    run_directory,
)
from utils.errors import ConfigError
from utils.precision import choose_precision

log = logging.getLogger("inference")


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
    deterministic = load_model(*beside, args.deterministic, layout) if beside else None
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
    sums, example, scores = roll_out(args, cfg, model, deterministic, data, mine, batch_size,
                                     layout, precision, norm, refs, E, save)
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
