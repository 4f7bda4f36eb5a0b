# Site preset: any SLURM cluster, no container, no GPU-specific options. This file is also
# the template for a new site: copy it to site/<name>.sh (use with SITE=<name>) or to
# site/local.sh (picked automatically), and change the values below. Every variable a site
# sets lives in this one file. Values already in the environment win over the defaults
# here, so `DATA_DIR=/somewhere sbatch ...` works without editing.
#
# Use:   source site/generic.sh; sbatch -n 2 submit_pm_dp.sh --config=cpu_short
#   or:  SITE=generic ./sbatch_site.sh -n 2 submit_pm_dp.sh --config=cpu_short

_name="${BASH_SOURCE[0]##*/}"; export SITE="${_name%.sh}"   # this file's name
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# ---- 1. Submission options. sbatch reads these SBATCH_* input variables from the
# environment (see `man sbatch`, INPUT ENVIRONMENT VARIABLES); command-line options win over
# them, and they win over the scripts' #SBATCH lines. Export only what your site needs:
# export SBATCH_ACCOUNT=myproject        # -A
# export SBATCH_QOS=normal               # -q
# export SBATCH_PARTITION=batch          # -p
# export SBATCH_CONSTRAINT=gpu           # -C
# export SBATCH_GPUS_PER_NODE=4          # --gpus-per-node
# export SBATCH_SIGNAL=USR1@120          # --signal: warn the tasks before the time limit
# export SBATCH_REQUEUE=1                # --requeue
# Options without an SBATCH_* variable (e.g. --cpus-per-task, container options) go here;
# only sbatch_site.sh passes them (a plain `sbatch` cannot read them from the environment):
export SITE_SBATCH_ARGS="${SITE_SBATCH_ARGS:-}"

# ---- 2. Run time (read inside the job by site/common.sh)
# Command placed in front of every task, e.g. a container launcher; empty: none.
export SITE_LAUNCHER="${SITE_LAUNCHER:-}"
# Extra srun options, e.g. "--cpus-per-task=8"; srun also reads SLURM_CPU_BIND (e.g. cores).
export SITE_SRUN_ARGS="${SITE_SRUN_ARGS:-}"
# export SLURM_CPU_BIND=cores
# Optional: network interface whose IPv4 address becomes MASTER_ADDR (e.g. hsn0, ib0); empty:
# the first node's address (export_DDP_vars.sh: its name, else its NodeAddr).
export SITE_MASTER_IFACE="${SITE_MASTER_IFACE:-}"
# GPU order seen by the tasks (LOCAL_RANK indexes it); empty: as SLURM sets it.
export SITE_CUDA_VISIBLE_DEVICES="${SITE_CUDA_VISIBLE_DEVICES:-}"
# Python: $PYTHON, else the repository's .venv (`make venv`), else python3 on PATH.
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$_repo/.venv/bin/python" ]; then PYTHON="$_repo/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHON
# Data (train/valid/test/stats, e.g. from `make data`) and logs; both replace the config's paths.
export DATA_DIR="${DATA_DIR:-$_repo/datasets/synthetic}"
export LOG_DIR="${LOG_DIR:-$_repo/logs}"
# torch.compile's caches (--enable_jit, e.g. cpu_short_opt): unset, they live in
# $LOG_DIR/torch_compile_cache/<host name>, which the tasks of a node and its later jobs reuse.
# A directory set here is used as it is, by every node, e.g. a node-local disk that jobs keep:
# export TORCHINDUCTOR_CACHE_DIR=/local/scratch/torch_compile_cache
unset _repo _name
