"""FourCastNet's published weights as a checkpoint of this project, to fine-tune.

    hf download nvidia/fourcastnet1 --local-dir fcn      # where Hugging Face is reachable
    python -m tools.fourcastnet_weights fcn/fcn.mdlus logs/afno_fourcastnet/published
    python train.py --config=afno_fourcastnet \
        --init_from logs/afno_fourcastnet/published/checkpoints/ckpt_00000000.pt

NVIDIA publishes FourCastNet (26 channels, 0.25 degrees) as Earth2Studio's FCN package
(Hugging Face `nvidia/fourcastnet1`: fcn.mdlus, global_means.npy, global_stds.npy): the
weights of PhysicsNeMo's `AFNO` in its `.mdlus` file, a zip (or, older, a tar) of
args.json (the constructor's arguments) and model.pt (the state dict). Read here without
PhysicsNeMo. The arguments must be the config's (`afno_fourcastnet`: networks/afno.py's
`afno_variant` reproduces the published architecture; a difference is one `error:` line,
exit code 2); the tensors map one to one onto ours:

    patch_embed.proj.{weight,bias}        -> patch_embed.{weight,bias}
    pos_embed (1, h w, D)                 -> pos_embed (1, h, w, D): the same numbers
    blocks.i.{norm1,norm2,mlp.fc1,mlp.fc2}-> the same names
    blocks.i.filter.{w1,b1,w2,b2}         -> the same names and layout ([real, imaginary],
                                             block, in, out)
    head.weight                           -> head.weight (no bias, no final norm)

The checkpoint is iteration 0 of a run of that config, with a fresh optimizer: what
`--init_from` starts a fine-tune from. Its inputs were normalised with FourCastNet's
statistics (the two .npy files of its package): a config of your own based on
`afno_fourcastnet` points global_means_path and global_stds_path at them
(docs/earth2studio.md).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
import zipfile
from collections.abc import Sequence
from typing import Any

import torch

from utils.config_schema import Config
from utils.errors import EXIT_USER_ERROR, CheckpointError, ConfigError, UserError

# PhysicsNeMo AFNO's defaults, for arguments an args.json leaves out.
DEFAULTS = {"patch_size": [16, 16], "embed_dim": 256, "depth": 4, "mlp_ratio": 4.0,
            "drop_rate": 0.0, "num_blocks": 16, "sparsity_threshold": 0.01,
            "hard_thresholding_fraction": 1.0}
RENAMED = {"patch_embed.proj.weight": "patch_embed.weight",
           "patch_embed.proj.bias": "patch_embed.bias"}


def read_mdlus(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(constructor arguments, state dict) of a PhysicsNeMo `.mdlus` file."""
    try:
        if tarfile.is_tarfile(path):
            with tarfile.open(path) as tar:
                files = {m.name.lstrip("./"): tar.extractfile(m).read() for m in tar.getmembers()
                         if m.isfile()}
        else:
            with zipfile.ZipFile(path) as archive:
                files = {name: archive.read(name) for name in archive.namelist()}
    except (OSError, zipfile.BadZipFile, tarfile.TarError) as e:
        raise CheckpointError(f"{path} is not a PhysicsNeMo .mdlus file ({e})") from None
    missing = [n for n in ("args.json", "model.pt") if n not in files]
    if missing:
        raise CheckpointError(f"{path} holds no {missing[0]}: not a PhysicsNeMo .mdlus file")
    args = json.loads(files["args.json"])
    state = torch.load(io.BytesIO(files["model.pt"]), map_location="cpu", weights_only=True)
    return args.get("__args__", args), state


def check_arguments(args: dict[str, Any], cfg: Config, where: str) -> None:
    """A one-line ConfigError unless the published model is the config's architecture."""
    p = cfg.patch_size
    expected = {"inp_shape": list(cfg.img_size), "in_channels": cfg.n_in_channels,
                "out_channels": cfg.n_out_channels, "patch_size": [p, p],
                "embed_dim": cfg.embed_dim, "depth": cfg.depth, "num_blocks": cfg.num_blocks,
                "mlp_ratio": cfg.mlp_ratio, "sparsity_threshold": cfg.sparsity_threshold,
                "hard_thresholding_fraction": cfg.hard_thresholding_fraction}
    for key, ours in expected.items():
        theirs = args.get(key, DEFAULTS.get(key))
        if (list(theirs) if isinstance(theirs, (list, tuple)) else theirs) != ours:
            raise ConfigError(f"{where}: {key} {theirs} in its args.json, the config "
                              f"'{cfg.config}' has {ours}: give the config of its architecture")
    if cfg.model != "afno" or cfg.afno_variant != "fourcastnet":
        raise ConfigError(f"{where} is FourCastNet's AFNO: the config '{cfg.config}' must be "
                          "model afno with afno_variant fourcastnet")


def to_ours(state: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    """Their state dict under our parameter names and shapes (module docstring)."""
    grid = (cfg.img_size[0] // cfg.patch_size, cfg.img_size[1] // cfg.patch_size)
    out = {}
    for name, tensor in state.items():
        if name == "pos_embed":
            tensor = tensor.reshape(1, *grid, tensor.shape[-1])
        out[RENAMED.get(name, name)] = tensor.float()
    return out


def convert(mdlus: str, cfg: Config) -> torch.nn.Module:
    """Our model of `cfg` holding the published weights of `mdlus`; a tensor that does not
    fit, or is missing or left over, is a one-line CheckpointError."""
    from networks.factory import build_model

    args, state = read_mdlus(mdlus)
    check_arguments(args, cfg, mdlus)
    model = build_model(cfg)
    ours = to_ours(state, cfg)
    missing = sorted(set(dict(model.named_parameters())) - set(ours))
    extra = sorted(set(ours) - set(dict(model.named_parameters())))
    if missing or extra:
        raise CheckpointError(f"{mdlus}: " + (f"no tensor for {missing[0]}" if missing else
                                              f"tensor {extra[0]}, which our AFNO does not have"))
    model.load_state_dict(ours, strict=True)
    return model


def save_checkpoint(model: torch.nn.Module, cfg: Config, exp_dir: str) -> str:
    """Iteration 0 of a run of `cfg` holding `model`'s weights (a fresh optimizer)."""
    from distributed.layout import Layout
    from training.checkpoint import Checkpointer
    from training.progress import Progress
    from training.run import build_optimizer, build_scheduler
    from utils.precision import Precision

    optimizer = build_optimizer(cfg, model)
    layout = Layout.of_groups(cfg, None, torch.device("cpu"))
    return Checkpointer(exp_dir, cfg, model, optimizer, build_scheduler(cfg, optimizer),
                        Precision("none").grad_scaler(), layout).save(Progress())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("mdlus", help="FourCastNet's fcn.mdlus (Earth2Studio's FCN package)")
    p.add_argument("out", help="a run directory: the checkpoint goes to OUT/checkpoints/")
    p.add_argument("--config", default="afno_fourcastnet", help="its architecture's config")
    p.add_argument("--yaml_config", default="./config/ViT.yaml")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from utils.config import read_config

    try:
        cfg = read_config(args.yaml_config, args.config)
        path = save_checkpoint(convert(args.mdlus, cfg), cfg, args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"Wrote {path}: FourCastNet's weights as config '{cfg.config}'; fine-tune with "
          f"python train.py --config={cfg.config} --init_from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
