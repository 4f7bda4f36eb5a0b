"""The tutorial's published runs, and what the time model, calibrated on one of them, says of
the others.

    traces = trace_runs(PUBLISHED)                   # one dry-run trace per distinct step
    model = calibrated_model(TimeModel(gpu, network), traces)   # on CALIBRATED_ON
    rows = comparison(model, traces)                 # published range, predicted, error

Every run: Perlmutter, A100 SXM (40 GB unless said), 4 per node, the editions' READMEs:
SC25 (github.com/NERSC/sc25-dl-tutorial) and SC24 (github.com/NERSC/sc24-dl-tutorial; its
`mp` logs of 2024-11-08 and -12 as a fork of the SC25 repository still carries them). A
range is the epochs a README shows (their samples/s). The config and flags are this
repository's (config/ViT.yaml mirrors the tutorial's: `short` is 360 x 720, patch 8, 4,050
tokens, embed 384, 8 heads, batch 16; `mp` embed 1,024, global batch 64); a run's loader
flags decide its input pipeline (planning/scaling_terms.py), the rest its step.
The model traces the eager step: the `--enable_jit` rows are predicted as eager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from planning.machines import GPUS, NETWORKS
from planning.planned_job import PlannedJob, Role
from planning.predict import calibrated_on
from planning.scaling_terms import input_bound_step
from planning.time_model import TimeModel
from utils.config import DEFAULT_YAML, read_config

LOADER_FLAGS = ("data_loader_config", "num_data_workers")
DALI_BF16 = {"data_loader_config": "dali", "num_data_workers": 8, "amp_mode": "bf16"}
FP32 = {"amp_mode": "none"}


@dataclass(frozen=True)
class PublishedRun:
    key: str
    edition: str
    what: str
    config: str
    flags: dict[str, Any]
    gpus: int
    samples_per_s: tuple[float, float]  # the published range
    gpu: str = "a100-40gb"
    extra: dict[str, Any] = field(default_factory=dict)

    def trace_key(self) -> tuple:
        """What decides the step's trace: all but the loader's flags."""
        step_flags = {k: v for k, v in self.flags.items() if k not in LOADER_FLAGS}
        return self.config, tuple(sorted(step_flags.items())), self.gpus


PUBLISHED = (
    PublishedRun("sc25-short-bf16", "SC25", "short, DALI, bf16", "short", DALI_BF16, 1,
                 (53.2, 54.0)),
    PublishedRun("sc25-short-fp16", "SC25", "short, DALI, fp16", "short",
                 {**DALI_BF16, "amp_mode": "fp16"}, 1, (53.3, 53.5)),
    PublishedRun("sc25-short-fused", "SC25", "short, DALI, bf16, fused Adam", "short",
                 {**DALI_BF16, "enable_fused": True}, 1, (53.3, 53.4)),
    PublishedRun("sc25-short-compile", "SC25", "short, DALI, bf16, fused Adam, compile",
                 "short", {**DALI_BF16, "enable_fused": True}, 1, (52.2, 55.0)),
    PublishedRun("sc24-short-fp32", "SC24", "short, fp32, no loader workers", "short",
                 FP32, 1, (9.3, 9.3)),
    PublishedRun("sc24-short-fp32-w4", "SC24", "short, fp32, 4 loader workers", "short",
                 {**FP32, "num_data_workers": 4}, 1, (12.4, 12.4)),
    PublishedRun("sc24-short-fp32-dali", "SC24", "short, fp32, DALI", "short",
                 {**FP32, "data_loader_config": "dali", "num_data_workers": 8}, 1,
                 (13.3, 13.3)),
    PublishedRun("sc24-short-bf16", "SC24", "short, DALI, bf16", "short", DALI_BF16, 1,
                 (42.6, 42.6)),
    PublishedRun("sc24-short-fused", "SC24", "short, DALI, bf16, fused Adam", "short",
                 {**DALI_BF16, "enable_fused": True}, 1, (42.7, 42.7)),
    PublishedRun("sc24-short-compile", "SC24", "short, DALI, bf16, fused Adam, compile",
                 "short", {**DALI_BF16, "enable_fused": True}, 1, (42.8, 42.8)),
    PublishedRun("sc24-mp-tp1-80gb", "SC24", "mp, dp 4", "mp", {}, 4,
                 (92.8, 93.3), gpu="a100-80gb"),
    PublishedRun("sc24-mp-tp4", "SC24", "mp, tp 4 x dp 4", "mp", {"tp": 4}, 16,
                 (123.6, 125.2)),
    PublishedRun("sc25-mp-tp4", "SC25", "mp, tp 4 x dp 4", "mp", {"tp": 4}, 16,
                 (125.5, 126.4)),
    PublishedRun("sc25-mp-cp4", "SC25", "mp, cp 4 x dp 4", "mp", {"cp": 4}, 16,
                 (164.4, 165.9)),
)
# The one run the model is calibrated on: one GPU, bound by its compute, of the edition
# that also published the multi-GPU `mp` runs (docs/scaling.md).
CALIBRATED_ON = "sc24-short-bf16"
# What that calibration gives with planning/rates.py's defaults: the dry run's default
# compute factor (tests/test_published_runs.py checks it against `calibrated_model`).
COMPUTE_FACTOR = 1.68


def run_named(key: str) -> PublishedRun:
    return next(r for r in PUBLISHED if r.key == key)


def config_of(run: PublishedRun) -> Any:
    return read_config(DEFAULT_YAML, run.config, environ={}).replace(**run.flags)


def trace_runs(runs: tuple[PublishedRun, ...] = PUBLISHED) -> dict[tuple, tuple[PlannedJob, Role]]:
    """One dry-run trace (rank 0) per distinct step of `runs`."""
    traces: dict[tuple, tuple[PlannedJob, Role]] = {}
    for run in runs:
        if run.trace_key() not in traces:
            job = PlannedJob(config_of(run), run.gpus, NETWORKS["perlmutter"].gpus_per_node)
            traces[run.trace_key()] = job, job.role(0, memory=False)
    return traces


def model_for(run: PublishedRun, model: TimeModel) -> TimeModel:
    """`model` on the run's GPU (its rates and factor kept)."""
    return TimeModel(GPUS[run.gpu], NETWORKS["perlmutter"], model.rates if
                     model.gpu.name == run.gpu else None, model.compute_factor,
                     link_efficiency=model.link_efficiency,
                     calibrated_from=model.calibrated_from)


def predicted_samples_per_s(run: PublishedRun, model: TimeModel,
                            traces: dict[tuple, tuple[PlannedJob, Role]]) -> float:
    job, role = traces[run.trace_key()]
    split = model_for(run, model).step(role.trace.events, job.axis_of, job.kind_of(role))
    step = input_bound_step(split.step_s, config_of(run), job.local_batch, model.rates)
    return job.global_batch / step


def calibrated_model(model: TimeModel, traces: dict[tuple, tuple[PlannedJob, Role]],
                     key: str = CALIBRATED_ON) -> TimeModel:
    """`model` with the compute factor that reproduces the published run `key` (the middle
    of its range); the run's loader must not bound it."""
    run = run_named(key)
    job, role = traces[run.trace_key()]
    return calibrated_on(role.trace.events, job, role, model_for(run, model),
                         sum(run.samples_per_s) / 2)


def error(predicted: float, published: tuple[float, float]) -> float:
    """The prediction's relative distance from the published range (0 inside it)."""
    lo, hi = published
    if lo <= predicted <= hi:
        return 0.0
    nearest = lo if predicted < lo else hi
    return (predicted - nearest) / nearest


def comparison(model: TimeModel, traces: dict[tuple, tuple[PlannedJob, Role]],
               runs: tuple[PublishedRun, ...] = PUBLISHED) -> list[dict[str, Any]]:
    """A row per published run: the published range, the prediction, the error."""
    rows = []
    for run in runs:
        predicted = predicted_samples_per_s(run, model, traces)
        rows.append({"key": run.key, "edition": run.edition, "what": run.what,
                     "gpus": run.gpus, "gpu": run.gpu, "published": run.samples_per_s,
                     "predicted": predicted, "error": error(predicted, run.samples_per_s),
                     "calibrated_on": run.key == CALIBRATED_ON})
    return rows
