# Source this inside each task started by `srun` (it is not meant to be executed):
#
#     srun bash -c 'source export_DDP_vars.sh && exec python train.py ...'
#
# It translates the SLURM task environment into the variables torch.distributed's
# env:// rendezvous reads:
#
#   RANK         = SLURM_PROCID     global rank of this task
#   LOCAL_RANK   = SLURM_LOCALID    rank of this task on its node (selects the GPU)
#   WORLD_SIZE   = SLURM_NTASKS     number of tasks (srun sets it to the step's count)
#   MASTER_ADDR  = DDP_MASTER_ADDR when set (the submit scripts set it when the site
#                  preset names a fast interface, e.g. hsn0), otherwise the address of the
#                  first node of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST / SLURM_NODELIST:
#                  its name when the name resolves, else (a node name need not be a host
#                  name: NodeName != NodeHostname/NodeAddr in slurm.conf, common on cloud and
#                  container clusters) the first of its NodeAddr and NodeHostName from
#                  `scontrol show node` that resolves, else its NodeAddr
#   MASTER_PORT  = MASTER_PORT when already set, otherwise 29500 + (SLURM_JOB_ID % 1000),
#                  so that two jobs sharing a node do not collide on one port
#                  (29500 when SLURM_JOB_ID is unknown).
#
# The node list is expanded with `scontrol show hostnames` when that works; inside a
# container without SLURM tools a pure-bash fallback handles the common forms:
# `host`, `host1,host2`, `host[1-4]`, `host[01,03]`, `nid[001234-001237,001240]`; there
# the first node's name is used as it is. The train script checks MASTER_ADDR before it
# starts torch.distributed (distributed/rendezvous.py): a name that does not resolve ends the job
# within seconds, with one line saying to set DDP_MASTER_ADDR.

_ddp_first_host() {
    local list="$1" first=""
    if command -v scontrol >/dev/null 2>&1; then
        first=$(scontrol show hostnames "$list" 2>/dev/null | head -n 1)
    fi
    if [ -z "$first" ]; then
        local head="${list%%,*}"
        if [[ "$head" == *"["* ]]; then
            # host[a-b,c]suffix -> host + a + suffix (zero padding is kept as written)
            local prefix="${list%%\[*}"
            local inner="${list#*\[}"
            local suffix="${inner#*\]}"
            inner="${inner%%\]*}"
            inner="${inner%%,*}"
            inner="${inner%%-*}"
            suffix="${suffix%%,*}"
            [[ "$suffix" == *"["* ]] && suffix=""
            first="${prefix}${inner}${suffix}"
        else
            first="$head"
        fi
    fi
    printf '%s\n' "$first"
}

_ddp_bounded() {  # a command, stopped after 10 s where `timeout` exists (a dead DNS server)
    if command -v timeout >/dev/null 2>&1; then timeout 10 "$@"; else "$@"; fi
}

_ddp_resolves() {  # a numeric address, or a name the resolver knows (unknown: assume so)
    [[ "$1" =~ ^[0-9]+(\.[0-9]+){3}$ || "$1" == *:* ]] && return 0
    command -v getent >/dev/null 2>&1 || return 0
    _ddp_bounded getent hosts "$1" >/dev/null 2>&1
}

_ddp_node_addr() {
    local name="$1" info addr host candidate
    # The name itself when it resolves: no call to the SLURM controller from every task.
    if _ddp_resolves "$name" || ! command -v scontrol >/dev/null 2>&1; then
        printf '%s\n' "$name"
        return
    fi
    info=$(_ddp_bounded scontrol show node "$name" -o 2>/dev/null)
    addr="" host=""
    if [[ "$info" =~ NodeAddr=([^ ]+) ]]; then addr="${BASH_REMATCH[1]}"; fi
    if [[ "$info" =~ NodeHostName=([^ ]+) ]]; then host="${BASH_REMATCH[1]}"; fi
    for candidate in "$addr" "$host"; do
        if [ -n "$candidate" ] && [ "$candidate" != "(null)" ] && _ddp_resolves "$candidate"; then
            printf '%s\n' "$candidate"
            return
        fi
    done
    printf '%s\n' "${addr:-$name}"
}

export RANK="${SLURM_PROCID:-0}"
export LOCAL_RANK="${SLURM_LOCALID:-0}"
export WORLD_SIZE="${SLURM_NTASKS:-1}"

if [ -n "${DDP_MASTER_ADDR:-}" ]; then
    export MASTER_ADDR="$DDP_MASTER_ADDR"
else
    _ddp_nodes="${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}}"
    if [ -n "$_ddp_nodes" ]; then
        MASTER_ADDR="$(_ddp_node_addr "$(_ddp_first_host "$_ddp_nodes")")"
        export MASTER_ADDR
    else
        export MASTER_ADDR="${MASTER_ADDR:-localhost}"
    fi
    unset _ddp_nodes
fi

if [ -z "${MASTER_PORT:-}" ]; then
    if [[ "${SLURM_JOB_ID:-}" =~ ^[0-9]+$ ]]; then
        export MASTER_PORT=$((29500 + SLURM_JOB_ID % 1000))
    else
        export MASTER_PORT=29500
    fi
fi
export MASTER_PORT
unset -f _ddp_first_host _ddp_bounded _ddp_resolves _ddp_node_addr
