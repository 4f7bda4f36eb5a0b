"""Named process groups for tensor (tp), context (cp), spatial (h, w), ensemble (ens) and data
(dp) parallelism.

Call `init(order, tp=..., cp=..., h=..., w=..., ens=...)` once per process after `torch.distributed`
is initialised (the train scripts do that; `init` initialises it from the launcher's
environment otherwise).
It builds, on every process, the groups it belongs to (utils/parallel_axes.py `GROUPS`):

    "tp"     ranks that hold different shards of the same layers (heads, MLP columns)
    "cp"     ranks that hold different slices of the token sequence
    "h", "w" ranks that hold different rows / columns of the (lat, lon) token grid (AFNO)
    "ens"    ranks that hold different members of an ensemble forecast of the same samples
    "dp"     ranks that hold the same model and see different samples (DDP averages here)
    "tp-cp"  tensor x context parallel ranks
    "h-w"    the spatial mesh: ranks that together hold the whole grid
    "mp"     the whole model-parallel group (tp x cp x h x w): one full model replica
    "mp-ens" the ranks that compute one loss together: "mp" and "ens" (every axis but dp)

Everything also works without torch.distributed (one process): sizes 1, ranks 0, groups None.
Before `init` on a distributed job every axis but dp has size 1 and dp is the whole world
(group None, i.e. torch's default group).

This module also owns process set-up (`init_process`: launcher, device, backend, groups),
the end of a job (`settle`, `shutdown`) and the few cross-rank agreements the run needs
(`any_rank`, `mean_over`).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Imported before any group exists, on purpose: torch.distributed.nn.functional binds
# `group.WORLD` as a default argument when it is first imported (DDP imports it, through
# torch._dynamo). Imported after init_process_group, that default would hold the world group,
# and gloo's threads with it, until the interpreter exits (see `shutdown`).
import torch.distributed.nn  # noqa: F401, I001

from distributed import rendezvous
from distributed.launch_env import LaunchEnv, resolve_launch_env
from distributed.rank_generator import RankGenerator
from distributed.startup_checks import run_startup_checks
from utils import devices
from utils.errors import ConfigError, LaunchError
from utils.openmp import threads_per_process
from utils.parallel_axes import DEFAULT_ORDER, GROUPS, mp_ens_size

GLOO_THREAD_NAMES = ("pt_gloo_runloop", "gloo_tcp_loop")
# gloo's TCP device is freed by whichever thread drops its last pair, so its loop thread can
# still be ending just after destroy_process_group() returns; a group that is really held
# keeps its threads for good.
SHUTDOWN_GRACE_SEC = 2.0

_sizes: dict[str, int] = {}
_ranks: dict[str, int] = {}
_groups: dict[str, dist.ProcessGroup | None] = {}
_group_names: dict[str, str] = {}  # torch.distributed's own name of each group


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def get_world_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def _check_name(name: str) -> None:
    if name not in GROUPS:
        raise KeyError(f"unknown process group {name!r}; expected one of {tuple(GROUPS)}")


def get_size(name: str) -> int:
    _check_name(name)
    if name in _sizes:
        return _sizes[name]
    return get_world_size() if name == "dp" else 1


def get_rank(name: str) -> int:
    _check_name(name)
    if name in _ranks:
        return _ranks[name]
    return get_world_rank() if name == "dp" else 0


def get_group(name: str) -> dist.ProcessGroup | None:
    """The process group `name` this rank belongs to (None on one process). A group of one
    rank has no process group (`init`): asking for it is an error, since None would mean the
    whole world to torch.distributed. Callers ask `get_size(name) > 1` first."""
    _check_name(name)
    if name in _sizes and name not in _groups and is_distributed():
        raise ValueError(f"process group {name!r} has one rank in this layout: there is "
                         "nothing to communicate over it (check comm.get_size first)")
    return _groups.get(name)


def get_group_name(name: str) -> str:
    """torch.distributed's name of the group `name` (a string a compiled graph can hold
    instead of the group itself: distributed/helpers.py)."""
    _check_name(name)
    return _group_names[name]


def init(order: str = DEFAULT_ORDER, backend: str | None = None, verbose: bool = False,
         **sizes: int) -> None:
    """Build the process groups of a tp x cp x h x w x ens x dp layout: `sizes` of every
    axis but dp (tp=2, h=2, ens=2, ...; 1 if not given), dp is what the world leaves.

    `order` lists the axes fastest-varying first (see distributed.rank_generator). Every process
    must call this with the same arguments: creating a group is collective over the world.
    `backend` is only used when this call has to initialise torch.distributed itself.

    What start-up costs at scale: a group is made once for each distinct partition of the
    world (`RankGenerator.partitions`: "tp-cp" is "tp" while cp = 1), none for groups of one
    rank, and a partition's groups all at once (`made_at_once`).
    """
    sized = tuple(GROUPS["mp-ens"])  # every axis but dp
    unknown = sorted(set(sizes) - set(sized))
    if unknown:
        raise TypeError(f"init() got sizes of {', '.join(unknown)}; the axes with a size are "
                        f"{sized} (dp is what the world leaves)")
    if not is_distributed():
        env = resolve_launch_env()
        if env.distributed:
            dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                                    init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                    timeout=collective_timeout())
    world = get_world_size()
    per_dp_rank = mp_ens_size(sizes)
    split = " x ".join(str(sizes.get(a, 1)) for a in sized)
    if min(sizes.values(), default=1) < 1 or world % per_dp_rank != 0:
        raise ConfigError(f"world size {world} is not divisible by {' x '.join(sized)}"
                          f" = {split}: choose sizes whose product divides it")
    layout = RankGenerator({**sizes, "dp": world // per_dp_rank}, order)
    rank = get_world_rank()
    reset()
    timeout = collective_timeout() if is_distributed() else None
    for name in GROUPS:  # a group of one rank: nothing crosses it, no process group is made
        _sizes[name], _ranks[name] = 1, 0
    for names, groups in layout.partitions():
        # collective over the whole world: every process makes every partition, in order
        group = made_at_once(groups, timeout) if is_distributed() else None
        members = next(g for g in groups if rank in g)
        for name in names:
            _sizes[name], _ranks[name], _groups[name] = len(members), members.index(rank), group
    _group_names.update({n: g.group_name for n, g in _groups.items() if g is not None})
    if verbose and rank == 0:
        axes = " x ".join(f"{a} {n}" for a, n in layout.sizes.items())
        print(f"comm: world {world} = {axes} (order {'-'.join(layout.order)}, fastest first)")


def made_at_once(groups: list[list[int]], timeout: timedelta) -> dist.ProcessGroup:
    """This rank's group of `groups`, a partition of the world, made by every rank together,
    its collectives bounded by `timeout`. On NCCL with a GPU bound to the world's group
    (`init_process`), where this PyTorch has `split_group`: one split of the world's
    communicator makes all of them (`split_arguments`). Elsewhere (gloo, an older PyTorch)
    one `new_group` after another (`new_subgroups_by_enumeration`); on NCCL each of those
    would be a split that every rank of the world joins. One group of the whole world is
    the world's own. Without `timeout`, either way, a group would wait as long as its
    backend's default, not the job's."""
    if len(groups) == 1:
        return dist.group.WORLD
    if splits_at_once():
        return dist.split_group(split_ranks=groups, **split_arguments(timeout))
    mine, _ = dist.new_subgroups_by_enumeration(groups, timeout=timeout)
    return mine


def splits_at_once() -> bool:
    """Whether `made_at_once` makes a partition's groups in one communicator split."""
    return (hasattr(dist, "split_group") and dist.get_backend() == "nccl"
            and getattr(dist.group.WORLD, "bound_device_id", None) is not None)


def split_arguments(timeout: timedelta) -> dict[str, Any]:
    """What `dist.split_group` needs, besides the ranks, for one split on every PyTorch
    from 2.7 on: the timeout, and NCCL options of its own, never the world's.

    Given no options, split_group takes the world backend's options object itself: in 2.7
    and 2.8 it writes this split's timeout, parent, colour, rank list and name into it (the
    world's collectives then wait as long as the split's); in 2.9 the C++ split writes
    them, and computes the rank list from the parent's own, which the previous split has
    overwritten: the second partition's split indexes past its end. 2.10 copies the
    world's options instead. Given no timeout, every release gives the split NCCL's
    default, not the world's. A new `ProcessGroupNCCL.Options` per split has the world's
    settings (`init_process` makes the world with the defaults), and nothing to share."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout  # split_group sets it from `timeout` too, later
    return {"timeout": timeout, "pg_options": options}


def collective_timeout() -> timedelta:
    """How long a collective of this job waits for a peer (DIST_TIMEOUT_SEC): the world
    group's and every group `init` makes."""
    return timedelta(seconds=rendezvous.timeouts().collective)


def shutdown() -> None:
    """End torch.distributed in this process: destroy every group and join gloo's threads.

    Call it on every rank after the last collective, once nothing else holds a group (a DDP
    model holds the dp group: let it go first). Why not just destroy_process_group(): a
    group's worker threads are joined only when its last reference goes. While a reference
    lives (our `_groups`, a DDP model), they live on into interpreter shutdown. A worker
    thread that is still dropping the tensors of the collective that just returned then needs
    the GIL, which at that point kills the thread in the middle of C++, and the process
    aborts ("terminate called without an active exception", exit -6) after a successful
    run. Here the last references go through the Python handles, which release the GIL
    while the threads are joined, so a worker can finish what it holds.
    """
    held = [group for group in _groups.values() if group is not None]
    reset()
    if not dist.is_initialized():
        return
    forget_device_meshes()
    gc.collect()  # reference cycles (a finished model, a traceback's frames) may hold a group
    held.append(dist.group.WORLD)
    dist.destroy_process_group()  # unregisters every group; `held` keeps ours alive until...
    held.clear()  # ...here, where they are freed and their threads joined, GIL released
    left = gloo_threads()
    waited = 0.0
    while left and waited < SHUTDOWN_GRACE_SEC:  # a transport thread still ending its loop
        time.sleep(0.05)
        waited += 0.05
        left = gloo_threads()
    if left:
        logging.getLogger("comm").warning(
            f"{left} gloo threads outlived comm.shutdown(): something still holds a "
            "process group, so this process may abort at exit")


def forget_device_meshes() -> None:
    """Drop what DTensor (FSDP's sharded parameters, distributed/fsdp.py) keeps after its
    tensors are gone: its caches (of sharding decisions, in Python and C++, of
    redistribution plans, of mesh topologies), whose entries hold a device mesh and with it
    the data-parallel group. PyTorch 2.13 has no public way to clear them all: its
    debugging helper clears the sharding caches, and every other one is a functools cache
    of a function or class of `torch.distributed.tensor` but the redistribution planners'
    dictionary, which has a function of its own."""
    if "torch.distributed.tensor" not in sys.modules:
        return  # nothing created a DTensor
    from torch.distributed.tensor import _redistribute, debug

    getattr(debug, "_clear_sharding_prop_cache", lambda: None)()
    getattr(_redistribute, "clear_redistribute_planner_cache", lambda: None)()
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed.tensor"):
            continue
        for value in list(vars(module).values()):
            members = vars(value).values() if isinstance(value, type) else [value]
            for member in members:
                member = getattr(member, "__func__", member)  # a staticmethod's function
                if hasattr(member, "cache_clear") and hasattr(member, "cache_info"):
                    member.cache_clear()


def gloo_threads() -> int:
    """gloo's worker and socket threads alive in this process (Linux; 0 where unknown)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() in GLOO_THREAD_NAMES
        except OSError:  # the thread ended meanwhile
            pass
    return count


def reset() -> None:
    """Forget the layout (tests; the groups themselves live until torch.distributed ends)."""
    _sizes.clear()
    _ranks.clear()
    _groups.clear()
    _group_names.clear()


# ----------------------------------------------------------------------------- process set-up

def init_process(order: str = DEFAULT_ORDER, **sizes: int) -> tuple[LaunchEnv, torch.device]:
    """Join the job (torchrun, SLURM or mpirun), pick the device, build the process groups
    (`init`: the `sizes` of every axis but dp, tp=2, ens=2, ...)."""
    run_startup_checks()  # a too-old torch, or GPUs assigned but not visible: one line, exit 2
    env = resolve_launch_env()
    device = process_device(env.local_rank,
                            torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        set_cuda_defaults()
    else:
        torch.set_num_threads(cpu_threads(env))
    if env.distributed:
        # The ranks meet first (bounded by DIST_CONNECT_TIMEOUT_SEC; one line and exit 2 if
        # they cannot); collectives then get their own bounded timeout (DIST_TIMEOUT_SEC): a
        # dead rank ends the job instead of hanging it for 30 minutes.
        limits = rendezvous.timeouts()
        store = rendezvous.join(env, limits)  # None under torchrun: env://, its agent's store
        try:  # with device_id, NCCL sets up its communicator here (and checks the GPUs)
            dist.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo", store=store,
                rank=env.rank, world_size=env.world_size,
                timeout=timedelta(seconds=limits.collective),
                device_id=device if device.type == "cuda" else None)
        except dist.DistBackendError as e:
            problem = shared_gpu_problem(str(e))
            if problem is None:
                raise
            raise LaunchError(problem) from None
    init(order, **sizes)  # every rank raises the same one-line error
    return env, device


def set_cuda_defaults() -> None:
    """How a GPU run computes: TF32 matmuls and convolutions unless the user turned them off
    the NVIDIA way (NVIDIA_TF32_OVERRIDE=0), and cuDNN choosing its fastest algorithms."""
    tf32 = os.environ.get("NVIDIA_TF32_OVERRIDE", "1") != "0"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = True


ONE_GPU_PER_RANK = ("start at most as many ranks per node as it has GPUs (torchrun "
                    "--nproc_per_node, sbatch --ntasks-per-node), or bind one GPU to each "
                    "task (srun --gpus-per-task=1)")


def process_device(local_rank: int, device_count: int, environ: Any = None) -> torch.device:
    """The device of the rank `local_rank` of its node, which sees `device_count` GPUs:
    its GPU (`cuda_index`), named with its index (utils/devices.py), or the CPU."""
    if device_count == 0:
        return torch.device("cpu")
    return devices.gpu(cuda_index(local_rank, device_count, environ))


def cuda_index(local_rank: int, device_count: int, environ: Any = None) -> int:
    """The GPU (index among the `device_count` this process sees) of the rank `local_rank`
    of its node: its local rank; or, for a task the launcher bound to GPUs of its own (it
    sees one, or SLURM_GPUS_PER_TASK is set), local rank modulo what it sees. A node running
    more ranks than GPUs is a one-line error here; two ranks on one GPU would otherwise
    fail later inside NCCL, with a multi-line "Duplicate GPU" error."""
    environ = os.environ if environ is None else environ
    seen = (f"{device_count} GPU{'s' if device_count > 1 else ''} "
            f"(CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    # torchrun gives every process of a node the same GPUs: each rank checks all of them.
    per_node = environ.get("LOCAL_WORLD_SIZE", "") if environ.get("TORCHELASTIC_RUN_ID") else ""
    if per_node.isdigit() and int(per_node) > device_count:
        raise LaunchError(f"torchrun starts {per_node} ranks per node, which see {seen}; "
                          f"{ONE_GPU_PER_RANK}", every_rank=True)
    if local_rank < device_count:
        return local_rank
    if device_count == 1 or environ.get("SLURM_GPUS_PER_TASK"):
        return local_rank % device_count  # GPUs bound to this task: if shared, NCCL says so
    raise LaunchError(f"local rank {local_rank} has no GPU of its own: this process sees "
                      f"{seen}, so this node runs more ranks than GPUs; {ONE_GPU_PER_RANK}")


def shared_gpu_problem(nccl_error: str) -> str | None:
    """The one-line error for NCCL's refusal of two ranks on one GPU ("Duplicate GPU
    detected : rank 1 and rank 0 both on CUDA device 1000", inside a multi-line
    DistBackendError), or None for any other NCCL error."""
    found = [line.strip() for line in nccl_error.splitlines() if "Duplicate GPU" in line]
    if not found:
        return None
    return f"two ranks of this node use the same GPU (NCCL: {found[0]}); {ONE_GPU_PER_RANK}"


def cpu_threads(env: LaunchEnv, environ: Any = None) -> int:
    """Intra-op threads for a CPU process (`utils.openmp.threads_per_process`, the rule the
    OpenMP wait policy counts with), given how many ranks share this node."""
    environ = os.environ if environ is None else environ
    per_node = environ.get("LOCAL_WORLD_SIZE") or environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if per_node is None and env.distributed:
        per_node = str(env.world_size)  # unknown layout: assume one node
    return threads_per_process(environ, int(per_node or 1))


# ----------------------------------------------------------------------------- agreements

def settle() -> None:
    """A barrier before the ranks leave together (a finished or preempted run, an error every
    rank raises): no rank shuts its connections down (`shutdown`) while a peer is still in a
    collective with it."""
    if is_distributed():
        dist.barrier()


def any_rank(flag: bool, device: torch.device | str = "cpu", group: str | None = None) -> bool:
    """True on every rank of `group` (default: the world) if `flag` is true on any of them.
    Collective: every rank must call it."""
    if not is_distributed():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=get_group(group) if group else None)
    return t.item() > 0


def sum_over(values: torch.Tensor, group: str) -> torch.Tensor:
    """In-place sum of `values` over the ranks of `group` (returns it)."""
    if is_distributed() and get_size(group) > 1:
        dist.all_reduce(values, group=get_group(group))
    return values


def mean_over(values: torch.Tensor, group: str) -> torch.Tensor:
    """In-place mean of `values` over the ranks of `group` (returns it)."""
    return sum_over(values, group).div_(get_size(group))


def broadcast_from_rank0(value: Any) -> Any:
    """World rank 0's `value` on every rank (one small pickled object)."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
