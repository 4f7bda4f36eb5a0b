"""Export a trained model as a package Earth2Studio runs (tools/earth2studio/package.py).

    python -m tools.export_earth2studio --config=cpu_quickstart exports/cpu_quickstart
    python -m tools.export_earth2studio --run_dir logs/cpu_quickstart/1CPU/00 OUT
    python -m tools.export_earth2studio --checkpoint RUN/checkpoints/ckpt_00000384.pt OUT

Any checkpoint of any layout (train.py, train_mp.py, FSDP, an ensemble): checkpoints hold
full tensors. `--config NAME` takes the newest checkpoint of the config's runs under its
log directory (LOG_DIR), as inference.py --config does. The package holds the weights, the
normalisation statistics and what the model is (config, channels and their Earth2Studio
names, grid, time step, ensemble); the data and statistics are found as inference.py finds
them (the paths saved in the checkpoint, relocated by DATA_DIR). Earth2Studio is not needed
here: tools.earth2studio.prognostic.Forecaster loads the package where it is installed
(docs/earth2studio.md).
A channel or grid Earth2Studio cannot name, a missing checkpoint or statistics file: one
`error:` line, exit code 2.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from collections.abc import Sequence

from utils.errors import EXIT_USER_ERROR, UserError


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--run_dir", help="a run directory: its newest checkpoint")
    which.add_argument("--checkpoint", help="a checkpoint file")
    which.add_argument("--config", help="a config: the newest checkpoint of its runs")
    p.add_argument("--yaml_config", default="./config/ViT.yaml")
    p.add_argument("out", help="the package's directory (new, empty, or a package)")
    return p.parse_args(argv)


def which_checkpoint(args: argparse.Namespace) -> str:
    """--checkpoint; the newest of --run_dir; of --config, its newest run's newest."""
    from training.checkpoint import latest_checkpoint
    from training.run_dirs import checkpoint_of_run, newest_checkpointed
    from utils.config import read_config
    from utils.errors import CheckpointError

    if args.checkpoint:
        return args.checkpoint
    if args.run_dir:
        return checkpoint_of_run(args.run_dir)
    pattern = os.path.join(read_config(args.yaml_config, args.config).expdir, args.config,
                           "*", "*")
    run = newest_checkpointed(sorted(glob.glob(pattern)))
    if run is None:
        raise CheckpointError(f"no checkpoint in {pattern}/checkpoints: train the config "
                              "first (set LOG_DIR as for training), or give --run_dir")
    return latest_checkpoint(run)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from tools.earth2studio.package import export

    try:
        checkpoint = which_checkpoint(args)
        metadata = export(checkpoint, args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    members = metadata["ensemble"]
    print(f"Exported {checkpoint} (iteration {metadata['checkpoint']['iteration']}, "
          f"{metadata['model']}) to {args.out}: {len(metadata['variables'])} variables "
          f"({', '.join(metadata['variables'])}), {len(metadata['latitude'])} x "
          f"{len(metadata['longitude'])} grid, {metadata['step_hours']} h steps"
          + (f", an ensemble of {members['size']} (noise-conditioned members)"
             if members else ", deterministic"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
