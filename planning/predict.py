"""The dry run's answers, as rows: each rank role of a job, each layout of a config, and a
layout's weak scaling over GPU counts (`python -m bench.dry_run` prints them).

    model = TimeModel(gpu, network)                             # planning/rates.py's rates
    rows = job_rows(PlannedJob(cfg, 1024, 4), model)           # one row per rank role
    rows = layout_rows(cfg, 16, 4, model)                      # one row per layout (rank 0)
    rows = scaling_rows(cfg, [4, 16, 64, 256, 1024], 4, model) # the same local batch

A row holds the layout (dp, tp, cp, h, w, fsdp, activation_checkpointing), the batch, the
model's FLOPs per sample (analytic: `networks.training_flops`, forward and backward), what
this rank's step was counted to do (`rank_flops`, `rank_bytes`), the step's split by the
time model (`compute_s`, `exposed_s` by axis, `step_s`) and the job's `samples_per_s` (the
global batch over the slowest role's step), the planner's `peak_gb`, `fits` what CUDA
reports of the GPU's memory (planning/memory_terms.py), `groups_ok`, the step's
`collectives` and the dry run's `wall_s` for the row.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import networks
from planning.layouts import fastest_key, layouts
from planning.memory_terms import usable_gib
from planning.planned_job import PlannedJob, Role
from planning.scaling_terms import input_bound_step, weak_scaling_step
from planning.time_model import TimeModel
from utils.config_schema import Config


def role_row(job: PlannedJob, role: Role, model: TimeModel) -> dict[str, Any]:
    """One rank role's row (module docstring); `samples_per_s` as if this role were the
    slowest (`job_rows` sets the job's)."""
    split = model.step(role.trace.events, job.axis_of, job.kind_of(role))
    sizes = job.generator.sizes
    peak = role.memory.get("peak_gb")
    return {
        "gpus": job.gpus, "rank": role.rank, "coords": role.coords,
        **{a: sizes[a] for a in ("dp", "tp", "cp", "h", "w", "ens")},
        "fsdp": role.fsdp, "activation_checkpointing": job.cfg.activation_checkpointing,
        "amp_mode": job.cfg.amp_mode, "local_batch": job.local_batch,
        "global_batch": job.global_batch,
        "flops_per_sample": networks.training_flops(job.cfg),
        "rank_flops": role.trace.flops(), "rank_bytes": role.trace.nbytes(),
        "compute_s": split.compute_s, "exposed_s": split.exposed, "link_busy_s": split.busy,
        "step_s": split.step_s, "samples_per_s": job.global_batch / split.step_s,
        "peak_gb": peak,
        "fits": None if peak is None else peak <= usable_gib(model.gpu.memory_gb),
        "memory": role.memory, "groups_ok": role.groups_ok, "group_problems": role.problems,
        "collectives": job.collective_rows(role.trace.collectives),
        "gpu": model.gpu.name, "network": model.network.name,
        "gpus_per_node": job.gpus_per_node, "compute_factor": model.compute_factor,
        "rates": model.rates.name,
        "wall_s": role.wall_s}


def job_rows(job: PlannedJob, model: TimeModel, ranks: list[int] | None = None,
             memory: bool = True) -> list[dict[str, Any]]:
    """A row per rank role (`PlannedJob.roles`, or `ranks`); every row's `samples_per_s` is the
    job's: the global batch over the slowest role's step; `groups_ok` also says the whole
    job's groups passed `PlannedJob.partition_problems` (`job_problems`)."""
    rows = [role_row(job, job.role(r, memory), model) for r in (ranks or job.roles())]
    slowest = max(r["step_s"] for r in rows)
    problems = job.partition_problems()  # the whole job's groups, checked once
    for r in rows:
        r["samples_per_s"] = job.global_batch / slowest
        r["job_problems"] = problems
        r["groups_ok"] = r["groups_ok"] and not problems
    return rows


def layout_rows(cfg: Config, gpus: int, gpus_per_node: int, model: TimeModel
                ) -> list[dict[str, Any]]:
    """A row per layout the planner lists for `cfg` on `gpus` (rank 0, which holds the
    bigger part of every uneven split); `fastest` on the one that fits with the most
    samples/s, `planner_pick` on the memory planner's rule's choice."""
    rows = []
    for layout in layouts(cfg, gpus):
        job = PlannedJob(cfg.replace(**layout.flags()), gpus, gpus_per_node, "cuda")
        [row] = job_rows(job, model, ranks=[0])
        tp_groups = job.generator.get_ranks("tp")
        row["tp_crosses_nodes"] = any(
            len({r // gpus_per_node for r in g}) > 1 for g in tp_groups)
        rows.append(row)
    fitting = [r for r in rows if r["fits"]]
    for r in rows:
        r["fastest"] = r["planner_pick"] = False
    if fitting:
        max(fitting, key=lambda r: r["samples_per_s"])["fastest"] = True
        min(fitting, key=lambda r: fastest_key(r, gpus_per_node))["planner_pick"] = True
    return rows


def scaling_rows(cfg: Config, gpu_counts: list[int], gpus_per_node: int, model: TimeModel,
                 local_batch: int) -> list[dict[str, Any]]:
    """The config's layout (its model-parallel sizes) at each GPU count with the same
    `local_batch` (weak scaling; rank 0). Each row adds the step with its loader
    (`loader_step_s`), the terms planning/scaling_terms.py adds at its high and low end
    (`terms`: {"high": {...}, "low": {...}} in seconds per step), `samples_per_s_range` and
    `scaling_efficiency_range` (low, high): samples/s per GPU against the first count's at
    the same end. `samples_per_s` and `scaling_efficiency` stay the step's alone."""
    fixed = cfg.replace(local_batch_size=local_batch)
    rows = []
    for gpus in gpu_counts:
        job = PlannedJob(fixed, gpus, gpus_per_node, "cuda")
        [row] = job_rows(job, model, ranks=[0])
        loaded = input_bound_step(row["step_s"], fixed, local_batch, model.rates)
        high, low = weak_scaling_step(loaded, fixed, local_batch, gpus, gpus_per_node, job.dp)
        row["loader_step_s"] = loaded
        row["terms"] = {"high": asdict(high), "low": asdict(low)}
        row["samples_per_s_range"] = (job.global_batch / low.total_s,
                                      job.global_batch / high.total_s)
        rows.append(row)
    base = rows[0]["samples_per_s"] / rows[0]["gpus"]
    base_range = [v / rows[0]["gpus"] for v in rows[0]["samples_per_s_range"]]
    for r in rows:
        r["scaling_efficiency"] = r["samples_per_s"] / r["gpus"] / base
        r["scaling_efficiency_range"] = tuple(v / r["gpus"] / b for v, b in
                                              zip(r["samples_per_s_range"], base_range,
                                                  strict=True))
    return rows


def calibrated(job: PlannedJob, model: TimeModel, samples_per_s: float) -> TimeModel:
    """The time model whose compute factor makes `job` (its first rank role) run at the
    measured `samples_per_s`: the config, flags and GPU count of that one measured run."""
    role = job.role(job.roles()[0], memory=False)
    return calibrated_on(role.trace.events, job, role, model, samples_per_s)


def calibrated_on(events: list[Any], job: PlannedJob, role: Role, model: TimeModel,
                  samples_per_s: float) -> TimeModel:
    """`calibrated` for a trace already made (`events` of `role` of `job`)."""
    kind = job.kind_of(role)

    def step_at(factor: float) -> float:
        return model.with_compute_factor(factor).step(events, job.axis_of, kind).step_s

    factor = model.calibrate(samples_per_s, job.global_batch, step_at)
    return model.with_compute_factor(factor, calibrated_from=samples_per_s)


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float, float]:
    """(fn(...), wall seconds, this process's CPU seconds)."""
    wall, cpu = time.time(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.time() - wall, time.process_time() - cpu

