#!/bin/bash
# One process (one GPU, or CPU) training run, e.g.
#     sbatch -n 1 -t 20 submit_pm.sh --config=short --num_data_workers 4
# Arguments after the script go to train.py (TRAIN_SCRIPT=<file> runs another script, e.g.
# inference.py). Submit from the repository root.
#
# Only portable #SBATCH lines are below: site-specific options (-C gpu, account, QOS,
# --gpus-per-node, container) come from the site preset, because #SBATCH lines cannot be
# conditional and a generic cluster rejects -C gpu or --gpus-per-node. On Perlmutter run
# `source site/perlmutter.sh` once in the shell (or submit with ./sbatch_site.sh); elsewhere
# `source site/generic.sh` or a preset of your own. See site/README.md.
# ENABLE_PROFILING=1 PROFILE_OUTPUT=name profiles the run (site/common.sh).
#SBATCH --job-name=vit-era5
#SBATCH --ntasks=1
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out

cd "${SLURM_SUBMIT_DIR:-.}" && source site/common.sh || { echo "submit from the repository root" >&2; exit 1; }
run_tasks "${TRAIN_SCRIPT:-train.py}" "$@"
