"""README pictures from a finished run: training curves and a t2m forecast map.

    python -m tools.plot_run --config cpu_base --run logs/cpu_base/1CPU/00 --out docs
"""

from __future__ import annotations

import argparse
import glob
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

from data.dataset import ERA5Dataset  # noqa: E402
from networks import build_model  # noqa: E402
from training.checkpoint import latest_checkpoint  # noqa: E402
from training.logs import target_vs_prediction  # noqa: E402
from training.run_dirs import newest_checkpointed  # noqa: E402
from utils.config import DEFAULT_YAML, read_config  # noqa: E402
from utils.config_schema import Config  # noqa: E402


def scalars(run_dir: str) -> dict[str, tuple[list[int], list[float]]]:
    acc = EventAccumulator(os.path.join(run_dir, "logs"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: ([e.step for e in acc.Scalars(tag)], [e.value for e in acc.Scalars(tag)])
            for tag in acc.Tags()["scalars"]}


def plot_curves(run_dir: str, out: str, label: str = "ViT") -> None:
    s = scalars(run_dir)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    for tag in ("Loss/train", "Loss/valid"):
        a.plot(*s[tag], label=tag)
    a.set_xlabel("iteration")
    a.set_ylabel("relative L2 loss")
    a.set_yscale("log")
    a.legend()
    b.plot(*s["RMSE(u10m)/valid"], label=label)
    b.plot(*s["RMSE(u10m)/persistence"], "--", label="persistence (t+6h = t)")
    b.set_xlabel("iteration")
    b.set_ylabel("RMSE(u10m) [m/s], validation")
    b.set_ylim(0, 2 * max(s["RMSE(u10m)/persistence"][1]))
    b.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


@torch.no_grad()
def plot_t2m(cfg: Config, run_dir: str, out: str, index: int = 0) -> None:
    model = build_model(cfg)
    ckpt = torch.load(latest_checkpoint(run_dir), map_location="cpu", weights_only=False)
    model.load_state_dict(ckpt["model"])
    model.eval()
    data = ERA5Dataset(cfg, cfg.valid_data_path, train=False)
    inp, tar = data[index]
    pred = model(inp[None])[0]
    mean, std = float(data.means[2, 0, 0]), float(data.stds[2, 0, 0])
    fig = target_vs_prediction((pred[2] * std + mean).numpy(), (tar[2] * std + mean).numpy(),
                               "t2m [K]", inp=(inp[2] * std + mean).numpy())
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--yaml_config", default=DEFAULT_YAML)
    p.add_argument("--config", default="cpu_base")
    p.add_argument("--run", default=None,
                   help="run directory (default: the newest single-process run of the config)")
    p.add_argument("--out", default="docs")
    args = p.parse_args()
    cfg = read_config(args.yaml_config, args.config)
    run = args.run or newest_checkpointed(
        glob.glob(os.path.join(cfg.expdir, args.config, "1[CG]PU", "*")))
    if run is None:
        raise SystemExit(f"error: no run of {args.config} with a checkpoint in "
                         f"{cfg.expdir}/{args.config}/1CPU|1GPU; give --run")
    os.makedirs(args.out, exist_ok=True)
    plot_curves(run, os.path.join(args.out, f"{args.config}_curves.png"),
                label={"vit": "ViT", "afno": "AFNO"}[cfg.model])
    plot_t2m(cfg, run, os.path.join(args.out, f"{args.config}_t2m.png"))
    print(f"wrote {args.out}/{args.config}_curves.png and {args.config}_t2m.png")


if __name__ == "__main__":
    main()
