"""Command-line flags shared by the train scripts, applied on top of a YAML config."""

from __future__ import annotations

import argparse
from typing import Any

from utils.errors import ConfigError
from utils.YParams import YParams


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--yaml_config", default="./config/ViT.yaml", type=str)
    p.add_argument("--config", default="cpu_short", type=str, help="section of the YAML file")
    p.add_argument("--run_num", default="00", type=str, help="tag of this run's directory")
    p.add_argument("--amp_mode", choices=["none", "fp16", "bf16"], default=None,
                   help="mixed precision (autocast); overrides the config")
    p.add_argument("--enable_fused", action="store_true", help="fused Adam kernel")
    p.add_argument("--enable_jit", action="store_true", help="torch.compile the model")
    p.add_argument("--local_batch_size", type=int, default=None,
                   help="per-process batch; global = local x data-parallel size")
    p.add_argument("--num_iters", type=int, default=None, help="training iterations")
    p.add_argument("--num_data_workers", type=int, default=None)
    p.add_argument("--data_loader_config", choices=["pytorch", "dali"], default=None)
    p.add_argument("--seed", type=int, default=None)
    # Data parallelism
    p.add_argument("--bucket_cap_mb", type=int, default=25, help="DDP gradient bucket size")
    p.add_argument("--disable_broadcast_buffers", action="store_true",
                   help="DDP: no buffer broadcast each step; uses gradient_as_bucket_view")
    p.add_argument("--noddp", action="store_true",
                   help="skip gradient all-reduce (wrong training; measures its cost)")
    # Checkpoints and preemption
    p.add_argument("--checkpoint_interval", type=int, default=None,
                   help="save every N iterations (and always at the end); 0 = only at the end")
    p.add_argument("--checkpoint_keep", type=int, default=None, help="keep the last K files")
    p.add_argument("--resume", nargs="?", const="auto", default=None,
                   help="resume from a checkpoint file, or from the run's newest ('auto')")
    p.add_argument("--requeue", action="store_true",
                   help="on SIGUSR1/SIGTERM: checkpoint, then `scontrol requeue` this job; "
                        "the requeued run (SLURM_RESTART_COUNT > 0) resumes by itself")
    return p


def add_model_parallel_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--tp", "--row_parallel_size", dest="tp", type=int, default=None,
                   help="tensor-parallel size (heads and MLP split across tp ranks)")
    p.add_argument("--cp", type=int, default=None,
                   help="context-parallel size (token sequence split across cp ranks)")
    p.add_argument("--h_parallel_size", type=int, default=None,
                   help="spatial parallel size over latitude rows (AFNO: distributed FFT)")
    p.add_argument("--w_parallel_size", type=int, default=None,
                   help="spatial parallel size over longitude columns (AFNO)")
    p.add_argument("--parallel_order", type=str, default=None,
                   help="rank layout, fastest-varying axis first, e.g. tp-cp-h-w-dp")
    return p


def positive(name: str, value: Any) -> int:
    if value is None or int(value) <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value}")
    return int(value)


# Flags copied into the config when given (a flag wins over the YAML value).
OVERRIDES = ("amp_mode", "num_iters", "num_data_workers", "data_loader_config", "seed",
             "tp", "cp", "h_parallel_size", "w_parallel_size", "parallel_order",
             "checkpoint_interval", "checkpoint_keep")
# Run settings that exist only as flags; they live in params too, so code reads one place.
RUN_FLAGS = ("run_num", "local_batch_size", "resume", "requeue", "noddp", "bucket_cap_mb",
             "disable_broadcast_buffers")


def load_params(args: argparse.Namespace) -> YParams:
    """YAML section + command-line flags (a flag wins over the config), validated once."""
    params = YParams(args.yaml_config, args.config)
    for key in OVERRIDES:
        value = getattr(args, key, None)
        if value is not None:
            params[key] = value
    for key in ("enable_fused", "enable_jit"):
        if getattr(args, key):
            params[key] = True
    params.update({key: getattr(args, key) for key in RUN_FLAGS})
    params.setdefault("tp", 1)
    params.setdefault("cp", 1)
    params.setdefault("h_parallel_size", 1)
    params.setdefault("w_parallel_size", 1)
    validate_params(params)
    return params


def validate_params(params: YParams) -> None:
    """Every check of values and of how they fit together, before anything is built."""
    for key in ("num_iters", "global_batch_size", "patch_size", "embed_dim", "num_heads",
                "depth", "tp", "cp", "h_parallel_size", "w_parallel_size"):
        params[key] = positive(key, params[key])
    if params.local_batch_size is not None:
        params.local_batch_size = positive("--local_batch_size", params.local_batch_size)
    if params.amp_mode not in ("none", "fp16", "bf16"):
        raise ConfigError(f"amp_mode must be none, fp16 or bf16, got {params.amp_mode}")
    H, W = params.img_size
    p = params.patch_size
    if H % p or W % p:
        raise ConfigError(f"img_size {H}x{W} is not a multiple of patch_size {p}")
    if params.embed_dim % params.num_heads:
        raise ConfigError(f"embed_dim {params.embed_dim} is not divisible by "
                          f"num_heads {params.num_heads}")
    # Model parallelism, checked once, before any layer is built: tp splits the heads and
    # the embedding (and with it the MLP's hidden units) across ranks, cp splits the tokens.
    tp, cp = params.tp, params.cp
    for key in ("num_heads", "embed_dim"):
        if params[key] % tp:
            raise ConfigError(f"{key} {params[key]} is not divisible by tp {tp} (--tp): "
                              f"choose a tp that divides it")
    tokens = (H // p) * (W // p)
    if cp > tokens:
        raise ConfigError(f"cp {cp} is larger than the {tokens} tokens of img_size {H}x{W} "
                          f"with patch_size {p}")
