"""inference.py's rollouts: a batch of initial conditions rolled forward lead by lead and
every lead scored as it comes, so memory does not grow with the leads.

    sums, maps, ensemble_sums = roll_out(args, cfg, model, deterministic, data, mine,
                                         batch_size, layout, precision, norm, refs, E, save)

- `evaluate`: a deterministic model's rollouts, scored with persistence and climatology
  beside them (evaluation/forecast_skill.py);
- `evaluate_ensemble`: E members of every initial condition (evaluation/ensemble_members.py)
  beside the deterministic model and the perfect-model ensemble, scored by CRPS, spread and
  rank (evaluation/ensemble_scores.py) and by their mean's RMSE and ACC;
- `save_lead`: the forecasts written into a WeatherBench-2 store (evaluation/forecast_file.py)
  a few leads at a time.
On a spatial mesh every rank rolls out its tile; each data-parallel rank its own share of the
initial conditions (`my_initial_conditions`); the sums are added up over them afterwards.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import numpy as np
import torch

from data.forecast import InitialCondition, RolloutData
from distributed import comm
from distributed.helpers import compute_split_shapes
from distributed.layout import Layout
from evaluation.ensemble_evaluation import EnsembleSums
from evaluation.ensemble_members import EnsembleForecast, PerfectEnsemble
from evaluation.forecast_file import write_forecasts
from evaluation.forecast_skill import FORECASTS, forecast_sums
from evaluation.inference_flags import IC_PERTURBATION, batch_for_grid
from evaluation.references import References
from evaluation.scores import Normaliser, whole_field
from utils.config_schema import Config
from utils.errors import ConfigError
from utils.precision import Precision

log = logging.getLogger("inference")


def batch_size_of(given: int | None, channels: int, grid: tuple[int, int], E: int | None
                  ) -> tuple[int, str]:
    """(initial conditions rolled out together, why): --batch_size, else as many as fit
    (`batch_for_grid`), divided among an ensemble's E members."""
    if given is not None:
        return given, "--batch_size"
    return (max(1, batch_for_grid(channels, *grid) // (E or 1)),
            f"chosen for the {grid[0]} x {grid[1]} grid" + (f" and {E} members" if E else ""))


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


def roll_out(args: argparse.Namespace, cfg: Config, model: torch.nn.Module,
             beside: torch.nn.Module | None, data: RolloutData, mine: list[InitialCondition],
             batch_size: int, layout: Layout, precision: Precision, norm: Normaliser,
             refs: References, E: int | None, save: tuple[str, int] | None
             ) -> tuple[torch.Tensor, np.ndarray, EnsembleSums | None]:
    """`evaluate`'s sums and maps, or an ensemble's (`evaluate_ensemble`) with its own
    scores' sums, added over the data-parallel ranks. `beside`: --deterministic's model."""
    c = data.channel_names().index(args.map_channel)
    if not E:
        return (*evaluate(model, data, mine, args.lead_steps, batch_size, layout, precision,
                          norm, refs, c, save), None)
    parts = ensemble_parts(args, cfg, beside, model, data, layout, len(norm.regions),
                           len(refs.channels), E)
    sums, example = evaluate_ensemble(model, data, mine, args.lead_steps, batch_size, layout,
                                      precision, norm, refs, c, **parts, save=save)
    return sums, example, parts["scores"].sum_over("dp")


def ensemble_parts(args: argparse.Namespace, cfg: Config, beside: torch.nn.Module | None,
                   model: torch.nn.Module, data: RolloutData, layout: Layout, regions: int,
                   channels: int, E: int) -> dict[str, Any]:
    """`evaluate_ensemble`'s members, deterministic model, perfect-model ensemble and score
    sums, each said in the log."""
    ensemble = EnsembleForecast.of(E, layout.members(cfg),
                                   args.ic_perturbation or IC_PERTURBATION, cfg.seed, layout.tile)
    log.info(ensemble.describe())
    deterministic = model if cfg.ensemble_size == 1 else beside
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
