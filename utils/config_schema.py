"""The config's schema: every key, its type, range, default, meaning and command-line flag,
declared once.

A config section (YAML merged with command-line flags) is checked once against `Config`
(pydantic v2): wrong types, out-of-range values, unknown or missing keys and inconsistent
combinations (utils/config_checks.py) become a one-line `ConfigError` that names the key,
its value, where it came from and what was expected. Valid values come back normalised (the
string "5E-4" -> 0.0005) in a frozen `Config`: what the code receives is what was checked,
and nothing changes it later (`cfg.replace(key=value)` makes a new, checked one).

    cfg = validate(section, where="config 'tiny' of config/ViT.yaml", flags={"seed"})

A key whose type carries `Flag()` is also a command-line flag (utils/config.py builds the
parser from here); `python -m tools.config_reference` renders this schema as
docs/config_reference.md.
"""

from __future__ import annotations

import difflib
import os
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Len, Lt, MinLen
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from utils.config_checks import check_across_keys
from utils.errors import ConfigError
from utils.parallel_axes import DEFAULT_ORDER, NAMES, parse_axes


class Expect:
    """Annotation metadata: how to say what a custom-validated value must be."""

    def __init__(self, text: str):
        self.text = text


class Flag:
    """Annotation metadata: the key is also a command-line flag, `--<key>` (and `aliases`).
    `model_parallel` flags exist only in the model-parallel scripts, a `script`'s only in
    that script; `const` is the value of the flag given without one (`--resume` alone
    means "auto")."""

    def __init__(self, *aliases: str, model_parallel: bool = False, script: str | None = None,
                 const: str | None = None):
        self.aliases, self.model_parallel, self.const = aliases, model_parallel, const
        self.script = script


def _single_path_component(value: str) -> str:
    # run_num names a directory under expdir/config/<N>CPU: it must not climb out of it.
    seps = {"/", os.sep, os.altsep or "/", "\0"}
    if value in ("", ".", "..") or any(s in value for s in seps):
        raise ValueError(value)
    return value


def _axis_order(value: str) -> str:
    if "dp" not in parse_axes(value):  # parse_axes rejects unknown or repeated axes
        raise ValueError(value)
    return value


# Members of an ensemble when the loss asks for one (`crps`) and ensemble_size is not given.
ENSEMBLE_DEFAULT = 4

PosInt = Annotated[int, Gt(0)]
NonNegInt = Annotated[int, Ge(0)]
PosFloat = Annotated[float, Gt(0)]
NonNegFloat = Annotated[float, Ge(0)]
Fraction = Annotated[float, Ge(0), Lt(1)]
Seed = Annotated[int, Ge(0), Le(2**32 - 1)]  # numpy's seed range
PathStr = Annotated[str, MinLen(1)]
RunTag = Annotated[str, AfterValidator(_single_path_component),
                   Expect("a single path component (no '/', not '.' or '..')")]
AxisOrder = Annotated[str, AfterValidator(_axis_order),
                      Expect(f"axes from {', '.join(NAMES)} joined by '-', each at most once, "
                             "dp included")]


class Keys(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class ModelKeys(Keys):
    """Model"""

    model: Literal["vit", "afno"] = Field("vit", description="network: ViT or AFNO (FourCastNet)")
    embed_dim: PosInt = Field(description="width of the token embedding")
    depth: PosInt = Field(description="number of transformer / AFNO blocks")
    patch_size: PosInt = Field(description="side of the square patch that becomes one token")
    num_heads: PosInt = Field(8, description="attention heads (ViT)")
    mlp_ratio: PosFloat = Field(4.0, description="MLP hidden width / embed_dim")
    num_blocks: PosInt = Field(8, description="block-diagonal blocks of the AFNO spectral weights")
    sparsity_threshold: NonNegFloat = Field(0.01, description="AFNO soft-shrink threshold")
    hard_thresholding_fraction: Annotated[float, Gt(0), Le(1)] = Field(
        1.0, description="fraction of Fourier modes AFNO keeps")
    afno_variant: Literal["default", "fourcastnet"] = Field(
        "default", description="AFNO: 'fourcastnet' is FourCastNet's published architecture "
        "(no final norm, head without bias, LayerNorm eps 1e-6, its Fourier modes), to load "
        "its weights (networks/afno.py, docs/earth2studio.md)")
    dropout: Fraction = Field(0.0, description="dropout probability")
    img_size: Annotated[list[PosInt], Len(2, 2)] = Field(
        description="grid [H, W] read from the data (the first H rows, W columns)")
    n_in_channels: PosInt = Field(description="input channels (20 in the ERA5 layout)")
    n_out_channels: PosInt = Field(
        description="predicted channels: the input's, n_in_channels (the forecast is the "
                    "next input)")
    noise_channels: PosInt = Field(
        4, description="ensembles (ensemble_size > 1): N(0, 1) noise channels per token that "
        "each member is conditioned on (networks/noise.py)")
    noise_embed_dim: PosInt = Field(
        32, description="ensembles: width of the noise embedding that scales and shifts the "
        "norms of every block")


class TrainingKeys(Keys):
    """Training"""

    dt: PosInt = Field(1, description="6-hour steps between input and target")
    rollout_steps: Annotated[PosInt, Flag()] = Field(
        1, description="training loss over K autoregressive steps of dt (1: one-step loss)")
    global_batch_size: PosInt = Field(description="samples per optimizer step, over all dp ranks")
    local_batch_size: Annotated[PosInt | None, Flag()] = Field(
        None, description="samples per rank; if set, global = local x dp size")
    num_iters: Annotated[PosInt, Flag()] = Field(
        description="training iterations (optimizer steps)")
    loss: Annotated[Literal["relative_l2", "weighted_mse", "crps"], Flag()] = Field(
        "relative_l2", description="training and validation loss (networks/loss.py): the "
        "tutorial's relative L2 error, the latitude-weighted MSE, or the latitude-weighted "
        "almost-fair CRPS of an ensemble forecast")
    ensemble_size: Annotated[PosInt, Flag()] = Field(
        1, description="members per initial condition: 1 a deterministic forecast; an "
        f"ensemble is trained with the `crps` loss (which, without this key, gives "
        f"{ENSEMBLE_DEFAULT} members)")
    crps_alpha: Annotated[float, Ge(0), Le(1), Flag()] = Field(
        0.95, description="training weight of the fair part of the `crps` loss (1: the fair "
        "CRPS, 0: the CRPS of the members' empirical distribution); validation and "
        "evaluation score the fair CRPS")
    lr: PosFloat = Field(description="peak learning rate")
    lr_schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="after warm-up: cosine decay to 0 at num_iters, or constant")
    warmup: NonNegInt = Field(0, description="iterations of linear LR warm-up")
    optimizer: Literal["Adam"] = Field("Adam", description="optimizer")
    betas: Annotated[list[Fraction], Len(2, 2)] = Field([0.9, 0.95], description="Adam betas")
    amp_mode: Annotated[Literal["none", "fp16", "bf16", "auto"], Flag()] = Field(
        "none", description="autocast precision; auto: bf16 where the hardware runs it "
        "natively (GPUs since Ampere, CPUs with AVX512-BF16/AMX), fp16 on older GPUs, else none")
    enable_fused: Annotated[bool, Flag()] = Field(False, description="fused Adam kernel")
    enable_jit: Annotated[bool, Flag()] = Field(False, description="torch.compile the model")
    seed: Annotated[Seed, Flag()] = Field(
        0, description="seed of weights, data order and dropout")
    skip_initial_validation: Annotated[bool, Flag()] = Field(
        False, description="start training at once, without validating the untrained model "
                           "(no step-0 point on the curves)")
    activation_checkpointing: Annotated[Literal["none", "blocks"], Flag()] = Field(
        "none", description="blocks: keep only each transformer / AFNO block's input for "
        "backward and recompute the block's activations there (less memory, more compute: "
        "docs/memory.md)")
    graph_warmup: Annotated[int, Ge(3), Flag(script="train_mp_graphs.py")] = Field(
        20, description="eager steps before the CUDA-graph capture: they create the loss "
        "scale and Adam's state the graph reuses (at least 3, PyTorch's warm-up for graphed "
        "callables; a DDP model gets at least 11)")


class RunKeys(Keys):
    """Run directory and checkpoints"""

    expdir: PathStr = Field(description="log root (LOG_DIR replaces it)")
    run_num: Annotated[RunTag | None, Flag()] = Field(
        None, description="run directory `expdir/<config>/<N>CPU/<run_num>`, reused as it is; "
                          "None: every run a new one (job id or next number, then the flags)")
    checkpoint_interval: Annotated[NonNegInt, Flag()] = Field(
        1000, description="iterations between checkpoints (0: only at the end)")
    checkpoint_keep: Annotated[PosInt, Flag()] = Field(3, description="newest checkpoints kept")
    init_from: Annotated[PathStr | None, Flag()] = Field(
        None, description="start from this checkpoint's weights: a fine-tune (iteration 0, "
                          "fresh optimizer and schedule; --resume wins)")
    resume: Annotated[str | None, Flag(const="auto")] = Field(
        None, description="resume from this checkpoint file, or ('auto', the flag alone) from "
                          "the newest checkpoint of the run it names (utils/config.py)")
    requeue: Annotated[bool, Flag()] = Field(
        False, description="on SIGUSR1/SIGTERM: checkpoint, then `scontrol requeue` the job; "
                           "the requeued run (SLURM_RESTART_COUNT > 0) resumes by itself")


class DataKeys(Keys):
    """Data"""

    data_loader_config: Annotated[Literal["pytorch", "dali"], Flag()] = Field(
        "pytorch", description="data loader")
    num_data_workers: Annotated[NonNegInt, Flag()] = Field(
        0, description="loader worker processes per rank")
    prefetch_thread: Annotated[bool, Flag()] = Field(
        False, description="PyTorch loader: read the next batches in a thread of the "
        "training process (small machines: no worker process competing for the cores)")
    data_dir: PathStr = Field(description="data root (DATA_DIR replaces it in every path below)")
    train_data_path: PathStr = Field(description="directory of the training years' .h5 files")
    valid_data_path: PathStr = Field(description="directory of the validation years")
    inf_data_path: PathStr = Field(description="directory of the test years")
    time_means_path: PathStr = Field(description="climatology (1, C, H, W) .npy, for ACC")
    global_means_path: PathStr = Field(description="per-channel means (1, C, 1, 1) .npy")
    global_stds_path: PathStr = Field(description="per-channel standard deviations .npy")
    limit_nsamples: PosInt | None = Field(None, description="use only the first N train samples")
    limit_nsamples_val: PosInt | None = Field(None, description="same for validation")


class ParallelKeys(Keys):
    """Parallelism and launch"""

    tp: Annotated[PosInt, Flag("--row_parallel_size", model_parallel=True)] = Field(
        1, description="tensor-parallel size (heads and MLP split across tp ranks)")
    cp: Annotated[PosInt, Flag(model_parallel=True)] = Field(
        1, description="context-parallel size (token sequence split across cp ranks)")
    h_parallel_size: Annotated[PosInt, Flag(model_parallel=True)] = Field(
        1, description="spatial-parallel ranks over token rows (AFNO: distributed FFT)")
    w_parallel_size: Annotated[PosInt, Flag(model_parallel=True)] = Field(
        1, description="spatial-parallel ranks over token columns (AFNO)")
    ensemble_parallel_size: Annotated[PosInt, Flag()] = Field(
        1, description="ranks an ensemble's members are split over (each holds "
        "ensemble_size / ensemble_parallel_size members of every sample)")
    parallel_order: Annotated[AxisOrder, Flag(model_parallel=True)] = Field(
        DEFAULT_ORDER, description="rank layout, fastest-varying axis first")
    bucket_cap_mb: Annotated[PosInt, Flag()] = Field(
        25, description="DDP gradient bucket size (MB; 25 is DDP's own default)")
    disable_broadcast_buffers: Annotated[bool, Flag()] = Field(
        False, description="DDP: no buffer broadcast each step; uses gradient_as_bucket_view")
    noddp: Annotated[bool, Flag()] = Field(
        False, description="skip the gradient all-reduce (wrong training; measures its cost)")
    fsdp: Annotated[bool, Flag()] = Field(
        False, description="shard parameters, gradients and optimizer state over the "
        "data-parallel ranks (FSDP2, per block) instead of replicating them with DDP "
        "(docs/memory.md)")
    no_reshard_after_forward: Annotated[bool, Flag()] = Field(
        False, description="FSDP: keep each block's gathered parameters from its forward to "
        "its backward (FSDP2's reshard_after_forward=False): one all-gather per block less, "
        "every block's whole parameters held meanwhile")


class SourceKeys(Keys):
    """Where the config came from (set by utils/config.py, saved in every checkpoint)"""

    config: str = Field("", description="the YAML section's name (--config)")
    yaml_config: str = Field("", description="the YAML file (--yaml_config)")
    flags: dict[str, Any] = Field(
        {}, description="the command-line flags that changed a value, `key: value`: they "
                        "name the run directory")


GROUPS: tuple[type[Keys], ...] = (ModelKeys, TrainingKeys, RunKeys, DataKeys, ParallelKeys,
                                  SourceKeys)


class Config(ModelKeys, TrainingKeys, RunKeys, DataKeys, ParallelKeys, SourceKeys):
    """Every key of a config section; checks across keys run once the keys are valid."""

    @model_validator(mode="before")
    @classmethod
    def _ensemble_default(cls, data: Any) -> Any:
        """A config that asks for an ensemble (loss crps) without saying how big gets
        ENSEMBLE_DEFAULT members; any other, one (a deterministic forecast)."""
        if isinstance(data, dict) and data.get("ensemble_size") is None:
            data = {**data,
                    "ensemble_size": ENSEMBLE_DEFAULT if data.get("loss") == "crps" else 1}
        return data

    def replace(self, **changes: Any) -> Config:
        """A new config with `changes`, checked like the original (this one is frozen)."""
        return validate({**self.model_dump(), **changes},
                        f"config '{self.config}' with {', '.join(changes)} changed",
                        flags=set(changes))

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        check_across_keys(self)  # utils/config_checks.py
        return self


KEYS: list[str] = [k for group in GROUPS for k in group.model_fields]

# The tutorial's keys that this code does without: a config copied from it is told why.
RETIRED: dict[str, str] = {
    "wireup_info": "the launcher (torchrun, SLURM, mpirun) and with it each rank's place "
                   "are found from the environment",
    "wireup_store": "the ranks meet at MASTER_ADDR:MASTER_PORT, checked first "
                    "(distributed/rendezvous.py)",
}


# ----------------------------------------------------------------- describing a type

_SYMBOL = {Gt: ">", Ge: ">=", Lt: "<", Le: "<="}
_BRACKET = {Gt: "(", Ge: "[", Lt: ")", Le: "]"}


def _bound(meta: list[Any], kinds: tuple[type, ...]) -> tuple[type, Any] | None:
    """(kind, value) of the first bound of these kinds (Gt(0) -> (Gt, 0)), or None."""
    m = next((m for m in meta if type(m) in kinds), None)
    return None if m is None else (type(m), getattr(m, type(m).__name__.lower()))


def _bounds(name: str, meta: list[Any]) -> str:
    low, high = _bound(meta, (Gt, Ge)), _bound(meta, (Lt, Le))
    if low and high:
        return f"{name} in {_BRACKET[low[0]]}{low[1]}, {high[1]}{_BRACKET[high[0]]}"
    if low or high:
        kind, value = low or high
        return f"{name} {_SYMBOL[kind]} {value}"
    if any(isinstance(m, MinLen) for m in meta):
        return f"non-empty {name}"
    return name


def describe(annotation: Any, metadata: list[Any] | tuple = ()) -> str:
    """A type as a person reads it: "int > 0", "float in [0, 1)", "one of 'vit', 'afno'"."""
    if get_origin(annotation) is Annotated:
        base, *meta = get_args(annotation)
        return describe(base, [*meta, *metadata])
    expect = next((m for m in metadata if isinstance(m, Expect)), None)
    if expect:
        return expect.text
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join("None" if a is type(None) else describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        n = next(m.min_length for m in metadata if isinstance(m, Len))
        return f"list of {n} ({describe(args[0])})"
    return _bounds(annotation.__name__, list(metadata))


def expected(key: str) -> str:
    field = Config.model_fields[key]
    return describe(field.annotation, field.metadata)


# ----------------------------------------------------------------- validating a section

def _culprit(key: str, value: Any, where: str, flags: set[str]) -> str:
    if key in flags:
        return f"--{key} {value}"
    return f"{key}: {value!r} in {where}"


def _explain(err: dict[str, Any], data: dict[str, Any], where: str, flags: set[str]) -> str:
    if not err["loc"]:  # a check across keys (model validator)
        return f"{where}: {err['ctx']['error']}"
    key = str(err["loc"][0])
    if err["type"] == "extra_forbidden" and key in RETIRED:
        return (f"key {_culprit(key, data.get(key), where, flags)} is no longer used: "
                f"{RETIRED[key]}; delete it")
    if err["type"] == "extra_forbidden":
        close = difflib.get_close_matches(key, KEYS, n=1)
        hint = f"did you mean '{close[0]}'?" if close else "see the config reference"
        return f"unknown key {_culprit(key, data.get(key), where, flags)}: {hint}"
    if err["type"] == "missing":
        return (f"{where} has no '{key}' (required: {expected(key)}, "
                f"{Config.model_fields[key].description})")
    return f"bad value {_culprit(key, data.get(key), where, flags)}: expected {expected(key)}"


def _order(err: dict[str, Any]) -> int:
    """Unknown keys first (a misspelling explains a missing key), then in schema order."""
    if not err["loc"]:
        return len(KEYS)  # a check across keys: last
    if err["type"] == "extra_forbidden":
        return -1
    return KEYS.index(str(err["loc"][0]))


def validate(data: dict[str, Any], where: str, flags: set[str] | frozenset = frozenset()
             ) -> Config:
    """The section `data` checked and normalised, with defaults for absent optional keys.

    `where` names the section for messages ("config 'tiny' of config/ViT.yaml"); `flags`
    are the keys whose value came from a command-line flag (messages name the flag).
    Raises ConfigError naming the first problem (and the keys of any others).
    """
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        errors = sorted(e.errors(), key=_order)
    first = _explain(errors[0], data, where, flags)
    others = list(dict.fromkeys(str(err["loc"][0]) for err in errors[1:] if err["loc"]))
    if errors[0]["loc"] and errors[0]["loc"][0] in others:
        others.remove(errors[0]["loc"][0])
    if others:
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        first += f" (also check {', '.join(others[:3])}{more})"
    raise ConfigError(first)
