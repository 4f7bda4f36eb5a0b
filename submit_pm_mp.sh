#!/bin/bash
# Model-parallel training (tensor/context parallel, or the AFNO's grid split over an h x w
# mesh; data parallel on top), 4 tasks per node, e.g.
#     sbatch --nodes 4 submit_pm_mp.sh --config=mp --row_parallel_size=4
#     sbatch --nodes 4 submit_pm_mp.sh --config=afno --h_parallel_size=4
# Runs train_mp.py; ENABLE_CUDA_GRAPHS=1 runs train_mp_graphs.py, TRAIN_SCRIPT=<file> any
# other. Arguments after the script go to it. Submit from the repository root.
#
# Only portable #SBATCH lines are below: site-specific options (-C gpu, account, QOS,
# --gpus-per-node, container) come from the site preset, because #SBATCH lines cannot be
# conditional and a generic cluster rejects -C gpu or --gpus-per-node. On Perlmutter run
# `source site/perlmutter.sh` once in the shell (or submit with ./sbatch_site.sh); elsewhere
# `source site/generic.sh` or a preset of your own. See site/README.md.
# ENABLE_PROFILING=1 PROFILE_OUTPUT=name profiles the run (site/common.sh).
#SBATCH --job-name=vit-era5-mp
#SBATCH --ntasks-per-node=4
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out

cd "${SLURM_SUBMIT_DIR:-.}" && source site/common.sh || { echo "submit from the repository root" >&2; exit 1; }
if [ "${ENABLE_CUDA_GRAPHS:-0}" = 1 ]; then
    TRAIN_SCRIPT="${TRAIN_SCRIPT:-train_mp_graphs.py}"
fi
run_tasks "${TRAIN_SCRIPT:-train_mp.py}" "$@"
