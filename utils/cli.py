"""Command-line flags shared by the train scripts, applied on top of a YAML config."""

from __future__ import annotations

import argparse

from utils.errors import ConfigError, UserError
from utils.launch_env import resolve_launch_env
from utils.run.run_dirs import run_label
from utils.YParams import YParams

BUCKET_CAP_MB = 25  # DDP's own default


class FlagParser(argparse.ArgumentParser):
    """argparse's parser; in a job of several processes only rank 0 prints a bad flag's usage
    and `error:` lines (every rank parses the same command line, and fails alike): the
    others raise the ConfigError that run_main leaves to rank 0."""

    def error(self, message: str):
        try:
            rank = resolve_launch_env().rank
        except UserError:  # a broken launcher environment: say it from every rank
            rank = 0
        if rank != 0:
            raise ConfigError(message)
        super().error(message)


def build_parser(description: str) -> argparse.ArgumentParser:
    p = FlagParser(description=description)
    p.add_argument("--yaml_config", default="./config/ViT.yaml", type=str)
    p.add_argument("--config", default="cpu_short", type=str, help="section of the YAML file")
    p.add_argument("--run_num", default=None, type=str,
                   help="name of this run's directory, reused as it is (default: a new name "
                        "for every run: the SLURM job id or the next free number, then the "
                        "flags given)")
    p.add_argument("--amp_mode", choices=["none", "fp16", "bf16", "auto"], default=None,
                   help="mixed precision (autocast); auto: bf16 or fp16 where the hardware "
                   "runs it natively, else none; overrides the config")
    p.add_argument("--enable_fused", action="store_true", help="fused Adam kernel")
    p.add_argument("--enable_jit", action="store_true", help="torch.compile the model")
    p.add_argument("--local_batch_size", type=int, default=None,
                   help="per-process batch; global = local x data-parallel size")
    p.add_argument("--num_iters", type=int, default=None, help="training iterations")
    p.add_argument("--num_data_workers", type=int, default=None)
    p.add_argument("--prefetch_thread", action="store_true",
                   help="read the next batches in a thread of the training process")
    p.add_argument("--data_loader_config", choices=["pytorch", "dali"], default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--rollout_steps", type=int, default=None,
                   help="train on the loss of K autoregressive steps (default 1)")
    p.add_argument("--init_from", type=str, default=None,
                   help="start from this checkpoint's weights (fine-tuning: iteration 0, "
                        "fresh optimizer)")
    # Data parallelism
    p.add_argument("--bucket_cap_mb", type=int, default=BUCKET_CAP_MB,
                   help="DDP gradient bucket size")
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


# Flags that set the config key of the same name (a flag wins over the config). The schema
# (utils.config_schema) checks them together with the YAML, and its messages name the flag.
FLAG_KEYS = ("amp_mode", "num_iters", "num_data_workers", "data_loader_config", "seed", "tp",
             "cp", "h_parallel_size", "w_parallel_size", "parallel_order",
             "checkpoint_interval", "checkpoint_keep", "run_num", "local_batch_size",
             "enable_fused", "enable_jit", "rollout_steps", "init_from",
             "prefetch_thread")
# Settings of this run only (not config keys): they live in params too, so that the code
# reads one place.
RUN_FLAGS = ("resume", "requeue", "noddp", "bucket_cap_mb", "disable_broadcast_buffers")


def load_params(args: argparse.Namespace) -> YParams:
    """YAML section + command-line overrides, checked against the config schema."""
    given = {key: getattr(args, key, None) for key in FLAG_KEYS}
    # None: a flag not given; False: a store_true flag not given (0 is a given value).
    overrides = {key: v for key, v in given.items() if v is not None and v is not False}
    params = YParams(args.yaml_config, args.config, overrides=overrides)
    params.update({key: getattr(args, key) for key in RUN_FLAGS})
    # The run directory's name shows the flags that change what is trained (the DDP ones
    # too: `--noddp` is a different measurement): TensorBoard's run list tells them apart.
    ddp = {"noddp": args.noddp, "disable_broadcast_buffers": args.disable_broadcast_buffers,
           "bucket_cap_mb": None if args.bucket_cap_mb == BUCKET_CAP_MB else args.bucket_cap_mb}
    params.run_label = run_label({**overrides, **ddp})
    return params
