"""How torch's idle OpenMP threads wait, chosen by what shares the cores, before torch loads
OpenMP (libgomp reads its environment once, when it is loaded).

A training step runs thousands of parallel regions (every GEMM and elementwise kernel).
Between two of them the pool's threads either spin, holding their core and starting the
next region at once, or sleep in the kernel, giving the core away and taking tens of
microseconds to wake. Spinning is faster when the training threads have the cores to
themselves. When something else needs those cores, a spinning thread holds the core its
partner thread (or the loader) needs, and the step runs several times slower.

    the training threads alone on their cores     ->  SPIN: libgomp's bounded spin (below)
    something busy shares them: other processes already running when the run starts,
    DALI's pipeline threads, or more threads than cores (ranks x threads)
                                                  ->  OMP_WAIT_POLICY=PASSIVE (sleep at once)
    OMP_WAIT_POLICY or GOMP_SPINCOUNT set by you  ->  yours, untouched

Loader worker processes do not count: they read a batch in a small part of a step, and
with one worker on 2 cores the spinning step measured faster than the sleeping one. A
process with one OpenMP thread has no pool to wait (DDP ranks on a small machine get one
each: distributed.comm.cpu_threads); nothing is set then either. Other processes are seen
once, at start-up (the runnable threads Linux counts in /proc/loadavg): a job that starts
competing later is not.

The scripts' start-up (training/startup.py) calls `set_before_torch` with the config it has
just read, the benchmarks `choose_before_torch(argv)`; the run's log says what was chosen
and why (`describe`). Measured both ways side by side: docs/benchmarks.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field

# The training threads alone: libgomp's own bounded spin (OMP_WAIT_POLICY unset: each idle
# thread spins GOMP_SPINCOUNT = 300,000 times, some milliseconds, then sleeps). It runs a
# step as fast as ACTIVE (endless spinning) does, and still gives the core away during
# longer waits (the loader, validation, checkpoints). docs/benchmarks.md has the numbers.
SPIN: dict[str, str] = {}
SLEEP = {"OMP_WAIT_POLICY": "PASSIVE"}
USER_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# Variables that say how many ranks of the job run on this node (torchrun, Open MPI, SLURM).
RANKS_PER_NODE = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


@dataclass(frozen=True)
class WaitPolicy:
    """The environment set (empty: nothing) and why, for the log."""

    env: dict[str, str] = field(default_factory=dict)
    why: str = ""

    def describe(self) -> str:
        setting = (", ".join(f"{k}={v}" for k, v in self.env.items())
                   or "libgomp's bounded spin (OMP_WAIT_POLICY unset)")
        return f"OpenMP wait policy: {setting}: {self.why}"


def _int(environ: Mapping[str, str], key: str) -> int | None:
    value = environ.get(key, "").split("(")[0]  # SLURM_NTASKS_PER_NODE may read "2(x3)"
    return int(value) if value.isdigit() and int(value) > 0 else None


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_process(environ: Mapping[str, str], ranks_per_node: int,
                        cores: int | None = None) -> int:
    """Intra-op threads of one CPU process: OMP_NUM_THREADS if set, else the CPUs SLURM gave
    the task, else the cores shared evenly by the node's ranks (several ranks with all cores
    each would oversubscribe the machine). distributed.comm sets torch's threads from it."""
    for key in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
        if (n := _int(environ, key)) is not None:
            return n
    return max(1, (cores or available_cores()) // max(1, ranks_per_node))


def busy_elsewhere(samples: int = 5, interval: float = 0.01) -> int:
    """Threads of other processes running now: the median over `samples` readings of the
    runnable threads in /proc/loadavg, less this one (0 where there is no /proc)."""
    counts = []
    for i in range(samples):
        try:
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)
        except (OSError, IndexError, ValueError):
            return 0
        if i + 1 < samples:
            time.sleep(interval)
    return max(0, sorted(counts)[len(counts) // 2])


def sharers(loader: str, ranks: int, threads: int, cores: int, busy: int) -> list[str]:
    """What else keeps this process's cores busy while its OpenMP threads wait."""
    found = []
    if busy and ranks * threads + busy > cores:
        found.append(f"{busy} busy thread{'s' if busy > 1 else ''} of other processes")
    if loader == "dali":
        found.append("DALI's pipeline threads")
    if ranks * threads > cores:
        found.append(f"{ranks} ranks x {threads} threads on {cores} cores")
    return found


def choose(workers: int, loader: str, environ: Mapping[str, str] | None = None,
           cores: int | None = None, busy: int = 0) -> WaitPolicy:
    """The wait policy for a run whose loader is `loader` ('pytorch' or 'dali') with
    `workers` worker processes, launched with `environ` (ranks per node, OMP_NUM_THREADS),
    with `busy` threads of other processes running (`busy_elsewhere`)."""
    environ = os.environ if environ is None else environ
    given = {k: environ[k] for k in USER_KEYS if environ.get(k)}
    if given:
        return WaitPolicy({}, "set by you (" + ", ".join(f"{k}={v}" for k, v in given.items())
                          + ")")
    cores = cores or available_cores()
    ranks = next((n for n in map(lambda k: _int(environ, k), RANKS_PER_NODE) if n), 1)
    threads = threads_per_process(environ, ranks, cores)
    if threads == 1 and loader != "dali":
        return WaitPolicy({}, "one OpenMP thread per process: no pool that waits")
    others = sharers(loader, ranks, threads, cores, busy)
    if others:
        return WaitPolicy(dict(SLEEP), "idle threads sleep at once: "
                          + ", ".join(others) + " share the cores")
    workers_note = f" ({workers} loader worker{'s' if workers > 1 else ''} aside)" \
        if workers else ""
    return WaitPolicy(dict(SPIN), f"{threads} training threads have {cores} cores to "
                      f"themselves{workers_note}: idle threads spin a while before they sleep")


_chosen: WaitPolicy | None = None


def set_before_torch(workers: int, loader: str,
                     environ: MutableMapping[str, str] | None = None) -> WaitPolicy:
    """Choose the wait policy of a run (`choose`, with the other processes busy now) and set
    it in `environ` (os.environ): before anything imports torch (training/startup.py)."""
    global _chosen
    environ = os.environ if environ is None else environ
    _chosen = choose(workers, loader, environ, busy=busy_elsewhere())
    environ.update(_chosen.env)
    return _chosen


def choose_before_torch(argv: Sequence[str], model_parallel: bool = False,
                        environ: MutableMapping[str, str] | None = None) -> WaitPolicy:
    """For a benchmark's command line: read the run's config from `argv` (its own flags
    left to it) and `set_before_torch`. A command line that does not parse is left to the
    benchmark, which reports it: nothing is set then."""
    environ = os.environ if environ is None else environ
    if any(a in ("-h", "--help") for a in argv):
        return WaitPolicy()
    from utils.config import flag_parser, flags_given, read_config  # torch-free, like this
    from utils.errors import ConfigError

    try:  # a benchmark's own flags are left to it
        args, _ = flag_parser("", model_parallel).parse_known_args(argv)
        cfg = read_config(args.yaml_config, args.config, flags=flags_given(args))
    except (ConfigError, OSError):
        return WaitPolicy()
    return set_before_torch(cfg.num_data_workers, cfg.data_loader_config, environ)


def describe(environ: Mapping[str, str] | None = None) -> str:
    """The log line: what `choose_before_torch` chose, or what the environment holds."""
    if _chosen is not None:
        return _chosen.describe()
    environ = os.environ if environ is None else environ
    given = ", ".join(f"{k}={environ[k]}" for k in USER_KEYS if environ.get(k))
    return f"OpenMP wait policy: {given or 'OMP_WAIT_POLICY unset (libgomp default)'}"
