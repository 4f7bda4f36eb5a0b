# The part the submit_pm*.sh scripts share; sourced inside the batch job from the
# repository root. It loads the site preset (site/load.sh), creates LOG_DIR, prints what
# will run, and defines `run_tasks SCRIPT [ARGS...]`, which starts one task per SLURM task:
#
#   srun [SITE_SRUN_ARGS] [SITE_LAUNCHER] bash -c '<task>' SCRIPT ARGS...
#
# where each task sources export_DDP_vars.sh (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
# MASTER_PORT from the SLURM task variables) and site/task.sh, whose `task_run` applies the
# site's GPU order (SITE_CUDA_VISIBLE_DEVICES, only when the task sees all of the node's
# GPUs) and execs `$PYTHON SCRIPT ARGS...`.
#
# Profiling: ENABLE_PROFILING=1 [PROFILE_OUTPUT=name] runs every task under
#   nsys profile -f true -o $LOG_DIR/<name> --trace=cuda,nvtx,osrt -c cudaProfilerApi
#        --capture-range-end=stop [--cuda-graph-trace=node for the CUDA-graph script]
# when nsys exists where the task runs (<name>_rank<RANK> with several tasks), and exports
# PROFILE_WITH_NSYS=1 so that the training script (training/profiling.py) opens and closes the
# capture range with torch.cuda.profiler.start()/stop() around its profiled epoch. Without
# nsys the run is not wrapped, and the training script writes a torch.profiler trace into
# its run directory: <run dir>/profile/<name>_rank<RANK>.<ms>.pt.trace.json.
# The details, and why, are in site/task.sh.

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export REPO_DIR
# shellcheck source=site/load.sh
source "$REPO_DIR/site/load.sh" || exit 1
mkdir -p "$LOG_DIR" || exit 1

# A fast interface for the rendezvous: this batch shell runs on the first node, where
# rank 0 runs, so its address on SITE_MASTER_IFACE is the master address.
if [ -n "${SITE_MASTER_IFACE:-}" ]; then
    _addr=$(ip -4 -o addr show dev "$SITE_MASTER_IFACE" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
    if [ -n "$_addr" ]; then export DDP_MASTER_ADDR="$_addr"; fi
    unset _addr
fi

# What one task runs (single quotes: expanded by the task's bash, inside any container).
_TASK='
source "$REPO_DIR/export_DDP_vars.sh" || exit 1
source "$REPO_DIR/site/task.sh" || exit 1
task_run "$@"
'

run_tasks() {
    echo "site=$SITE job=${SLURM_JOB_ID:-} nodes=${SLURM_JOB_NUM_NODES:-?} tasks=${SLURM_NTASKS:-?}" \
         "python=$PYTHON data=$DATA_DIR logs=$LOG_DIR"
    echo "+ srun $SITE_SRUN_ARGS $SITE_LAUNCHER $PYTHON $*"
    # No `srun -u`: it runs tasks on a pseudo-terminal, whose output srun forwards in chunks
    # that can cut lines of different ranks into each other. srun's default forwards whole
    # lines; PYTHONUNBUFFERED keeps them prompt.
    # shellcheck disable=SC2086  # SITE_SRUN_ARGS / SITE_LAUNCHER are word lists
    PYTHONUNBUFFERED=1 srun --kill-on-bad-exit=1 $SITE_SRUN_ARGS $SITE_LAUNCHER \
        bash -c "$_TASK" task "$@"
}
