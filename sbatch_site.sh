#!/bin/bash
# sbatch with the site preset's submission options, without changing your shell:
#     ./sbatch_site.sh [sbatch options] submit_pm_dp.sh [train.py arguments]
#     SITE=generic ./sbatch_site.sh -n 2 submit_pm_dp.sh --config=cpu_short
# Loads the preset chosen by site/load.sh (SITE, site/local.sh, NERSC_HOST, else generic),
# which exports its SBATCH_* variables, then runs sbatch with SITE_SBATCH_ARGS (options that
# have no SBATCH_* variable, e.g. Shifter's --image) before your own options.
source "$(dirname "${BASH_SOURCE[0]}")/site/load.sh" || exit 1
# shellcheck disable=SC2086  # SITE_SBATCH_ARGS is a word list
exec sbatch $SITE_SBATCH_ARGS "$@"
