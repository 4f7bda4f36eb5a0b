# Site preset: NERSC Perlmutter GPU nodes (4x A100, 64 cores), the tutorial's settings.
# Same variables as site/generic.sh (the commented template); values already in the
# environment win over the defaults below (another image: SITE_IMAGE=...,
# SITE_SHIFTER_MODULES=...).
#
# Use (once per login shell, then the tutorial's command lines work verbatim):
#     source site/perlmutter.sh
#     sbatch -N 4 submit_pm_dp.sh --config=bs256_opt
# or, without changing the shell (also pre-stages the container image on the nodes):
#     ./sbatch_site.sh -N 4 submit_pm_dp.sh --config=bs256_opt

_name="${BASH_SOURCE[0]##*/}"; export SITE="${_name%.sh}"   # this file's name

# ---- 1. Submission options (sbatch reads SBATCH_* from the environment)
export SBATCH_CONSTRAINT="${SBATCH_CONSTRAINT:-gpu}"      # -C gpu
export SBATCH_QOS="${SBATCH_QOS:-regular}"                 # -q regular (whole nodes)
export SBATCH_GPUS_PER_NODE="${SBATCH_GPUS_PER_NODE:-4}"   # --gpus-per-node 4
# -A: your project is charged unless you name one, e.g. the event's training account:
#     export SBATCH_ACCOUNT=<project>  (before or after sourcing this file)
# Checkpoint/requeue before the time limit, when the training script handles the signal:
#     export SBATCH_SIGNAL=USR1@120 SBATCH_REQUEUE=1
# Options with no SBATCH_* variable; passed by sbatch_site.sh only. --image/--module make
# Shifter set the image up once per node at job start instead of at task launch.
# The image's PyTorch must be >= 2.7.1 (checked at start-up, distributed/startup_checks.py): NGC
# PyTorch 25.12 ships PyTorch 2.10.0a0 on CUDA 13.1 (NVIDIA's release notes for 25.12).
# Pull it once: shifterimg pull nvcr.io/nvidia/pytorch:25.12-py3
_image="${SITE_IMAGE:-nvcr.io/nvidia/pytorch:25.12-py3}"
# gpu: the node's CUDA driver; nccl-plugin: NCCL's libfabric plugin for the Slingshot network.
_modules="${SITE_SHIFTER_MODULES:-gpu,nccl-plugin}"
export SITE_SBATCH_ARGS="${SITE_SBATCH_ARGS:---image=$_image --module=$_modules}"

# ---- 2. Run time (read inside the job by site/common.sh)
export SITE_LAUNCHER="${SITE_LAUNCHER:-shifter --image=$_image --module=$_modules}"
# 4 tasks per node x 32 logical CPUs, each task bound to its cores.
export SITE_SRUN_ARGS="${SITE_SRUN_ARGS:---cpus-per-task=32}"
export SLURM_CPU_BIND="${SLURM_CPU_BIND:-cores}"
# Rendezvous over the Slingshot interface.
export SITE_MASTER_IFACE="${SITE_MASTER_IFACE:-hsn0}"
# Reversed GPU order: with cores bound as above, local rank i then runs on the GPU nearest
# to its CPU cores (GPU 3 is closest to the first NUMA domain). Applied only to tasks that see
# all 4 GPUs (site/task.sh); a task bound to its own GPU (--gpus-per-task=1) keeps it.
export SITE_CUDA_VISIBLE_DEVICES="${SITE_CUDA_VISIBLE_DEVICES:-3,2,1,0}"
# Python: $PYTHON, else the venv made on top of the image (site/README.md, "Python packages
# on Perlmutter"; it adds this project's packages, or the tested torch, to the image's),
# else the image's own python.
_venv="${SITE_VENV:-${SCRATCH:-$HOME}/vit-era5/venv}"
if [ -z "${PYTHON:-}" ]; then
    if [ -f "$_venv/pyvenv.cfg" ]; then PYTHON="$_venv/bin/python"; else PYTHON=python; fi
fi
export PYTHON
export DATA_DIR="${DATA_DIR:-${SCRATCH:-$HOME}/vit-era5/data}"
export LOG_DIR="${LOG_DIR:-${SCRATCH:-$HOME}/vit-era5/logs}"
# Libfabric/NCCL settings for Slingshot, and no HDF5 file locks on Lustre.
export FI_MR_CACHE_MONITOR="${FI_MR_CACHE_MONITOR:-userfaultfd}"
export NCCL_NET_GDR_LEVEL="${NCCL_NET_GDR_LEVEL:-PHB}"
export HDF5_USE_FILE_LOCKING=FALSE
unset _image _modules _name _venv
