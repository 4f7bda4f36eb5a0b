#!/bin/bash
# Data-parallel training (DDP), one task per GPU: 4 tasks per node, e.g.
#     sbatch -N 4 submit_pm_dp.sh --config=bs256_opt
# Other task counts from the command line, e.g. on a CPU cluster:
#     sbatch -N 1 --ntasks-per-node=2 submit_pm_dp.sh --config=cpu_bs32_opt
# Arguments after the script go to train.py. Submit from the repository root.
#
# Only portable #SBATCH lines are below: site-specific options (-C gpu, account, QOS,
# --gpus-per-node, container) come from the site preset, because #SBATCH lines cannot be
# conditional and a generic cluster rejects -C gpu or --gpus-per-node. On Perlmutter run
# `source site/perlmutter.sh` once in the shell (or submit with ./sbatch_site.sh); elsewhere
# `source site/generic.sh` or a preset of your own. See site/README.md.
# ENABLE_PROFILING=1 PROFILE_OUTPUT=name profiles the run (site/common.sh).
#SBATCH --job-name=vit-era5-dp
#SBATCH --ntasks-per-node=4
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out

cd "${SLURM_SUBMIT_DIR:-.}" && source site/common.sh || { echo "submit from the repository root" >&2; exit 1; }
run_tasks train.py "$@"
