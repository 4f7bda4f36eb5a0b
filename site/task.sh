# What one task of a job runs, as functions (bash). site/common.sh starts every task as
#
#     source export_DDP_vars.sh; source site/task.sh; task_run SCRIPT [ARGS...]
#
# and the tests call the functions one by one, without srun, nsys or a GPU:
#
#   task_gpu_order          prints the GPU order the task should use (the site's
#                           SITE_CUDA_VISIBLE_DEVICES), or nothing to keep what SLURM set
#   task_command SCRIPT ... sets the array TASK_CMD to the command line that runs SCRIPT
#                           (under nsys when profiling), and exports the profiling variables
#   task_run SCRIPT ...     the GPU order, one `task RANK=...` line, then exec TASK_CMD
#
# GPU order. A site reorders GPUs so that local rank i lands on the GPU nearest its CPU cores
# (Perlmutter: 3,2,1,0). That is only right when the task sees all of the node's GPUs, i.e.
# when SLURM's CUDA_VISIBLE_DEVICES holds exactly the GPUs the site order names. A task bound
# to some of them (srun --gpus-per-task=1, --gpu-bind) keeps SLURM's list: forcing 3,2,1,0
# there would name GPUs the task cannot use, and CUDA would see none at all. Without any
# CUDA_VISIBLE_DEVICES the order is applied when nvidia-smi lists exactly those GPUs.
#
# Profiling. ENABLE_PROFILING=1 runs the task under
#     nsys profile -f true -o $LOG_DIR/<name> --trace=cuda,nvtx,osrt -c cudaProfilerApi
#          --capture-range-end=stop [--cuda-graph-trace=node]
# where nsys exists (<name> = PROFILE_OUTPUT or profile, plus _rank<RANK> when there are
# several tasks). -f true lets a second run with the same name overwrite the report (nsys
# refuses otherwise); --cuda-graph-trace=node, for the CUDA-graph script (its name contains
# "graphs", or ENABLE_CUDA_GRAPHS=1), traces each kernel of a graph replay instead of one
# opaque block per replay. PROFILE_WITH_NSYS=1 tells the training script to open and close
# the capture range (training/profiling.py). Without nsys the task runs bare and the training
# script writes a torch.profiler trace into its run directory (<run dir>/profile/).

_task_sorted() {  # "3, 2,1,0" -> "0,1,2,3"
    tr ',' '\n' <<<"$1" | tr -d ' ' | sed '/^$/d' | sort -n | paste -sd, -
}

task_gpu_order() {
    local want="${SITE_CUDA_VISIBLE_DEVICES:-}"
    [ -n "$want" ] || return 0
    if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
        # Empty: every GPU hidden on purpose. Otherwise reorder only a permutation of it.
        if [ -n "$CUDA_VISIBLE_DEVICES" ] &&
           [ "$(_task_sorted "$CUDA_VISIBLE_DEVICES")" = "$(_task_sorted "$want")" ]; then
            printf '%s\n' "$want"
        fi
        return 0
    fi
    command -v nvidia-smi >/dev/null 2>&1 || return 0
    local n
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    if [ "$n" -gt 0 ] && [ "$(_task_sorted "$want")" = "$(seq -s, 0 $((n - 1)))" ]; then
        printf '%s\n' "$want"
    fi
    return 0
}

_task_uses_cuda_graphs() {
    [ "${ENABLE_CUDA_GRAPHS:-0}" = 1 ] && return 0
    case "${1##*/}" in *graphs*.py) return 0 ;; esac
    return 1
}

task_command() {
    TASK_CMD=("$PYTHON" "$@")
    case "${ENABLE_PROFILING:-0}" in ""|0|false|False) return 0 ;; esac
    # Without nsys the training script writes a torch.profiler trace into its own run
    # directory (<run dir>/profile/), as it does outside SLURM: nothing to set here.
    command -v nsys >/dev/null 2>&1 || return 0
    local out="$LOG_DIR/${PROFILE_OUTPUT:-profile}"
    if [ "${WORLD_SIZE:-1}" -gt 1 ]; then out="${out}_rank${RANK:-0}"; fi
    local args=(profile -f true -o "$out" --trace=cuda,nvtx,osrt -c cudaProfilerApi
                --capture-range-end=stop)
    if _task_uses_cuda_graphs "$1"; then args+=(--cuda-graph-trace=node); fi
    export PROFILE_WITH_NSYS=1
    TASK_CMD=(nsys "${args[@]}" "$PYTHON" "$@")
}

task_run() {
    local order
    order=$(task_gpu_order)
    if [ -n "$order" ]; then export CUDA_VISIBLE_DEVICES="$order"; fi
    if [ "$RANK" = 0 ] || [ "$WORLD_SIZE" -le 16 ]; then
        echo "task RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE" \
             "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT host=$(hostname)" \
             "node=${SLURM_NODEID:-?} CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}"
    fi
    task_command "$@"
    exec "${TASK_CMD[@]}"
}
