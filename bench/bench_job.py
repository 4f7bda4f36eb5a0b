"""What a learner waits for: whole `python train.py` jobs, timed from process start to exit,
with torch.compile's cache cold and warm.

    DATA_DIR=datasets/synthetic python -m bench.bench_job                 # 128 iterations, 2 rounds
    python -m bench.bench_job --num_iters 32 --rounds 1 --config cpu_short
    python -m bench.bench_job --wait_policy --num_iters 64 --rounds 3   # OpenMP waiting

Every round runs these jobs one after the other (a fresh log directory each):
  eager fp32        --config=<config>                     (the baseline, cpu_short)
  eager bf16        --config=<config> + amp auto, fused Adam, prefetch thread: the `_opt`
                    settings without torch.compile
  compiled, cold    --config=<config>_opt, a new empty compile cache
  compiled, warm    --config=<config>_opt again, with the cache the cold job just filled
                    (what a second submission of the same config finds)
Per job: wall time (spawn to exit), time to the first step and the compile time the job
logged (training/compile_cost.py), the FX graph cache's hits, and samples/s of the epochs
after the first. Medians over rounds are printed, and the iterations after which compiling
pays for itself: compile time / (eager bf16 step time - compiled step time).
The machine may be shared: rounds interleave the jobs, so that load hits all of them alike.

`--wait_policy` times instead how idle OpenMP threads wait (utils/openmp.py): <config> in
the default environment (the policy train.py chooses), with OMP_WAIT_POLICY=ACTIVE (spin
endlessly) and with OMP_WAIT_POLICY=PASSIVE (sleep at once), each without and with a loader
worker process (`--num_data_workers 1`); per group, samples/s against ACTIVE's. With
`--busy` every job runs next to one busy process, as on a machine shared with another job.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FIRST_STEP = re.compile(r"First step done ([\d.]+) s after the process started"
                        r"(?:; torch\.compile ([\d.]+) s for (\d+) graphs "
                        r".*?(\d+) hits, (\d+) misses)?")
WHOLE_RUN = re.compile(r"Whole run: torch\.compile ([\d.]+) s for (\d+) graphs")
EPOCH = re.compile(r"Time taken for epoch (\d+) is [\d.]+ sec, avg ([\d.]+) samples/sec")
BATCH = re.compile(r"global batch (\d+), local batch")  # the run's, resolved at start
VALIDATION = re.compile(r"Total validation time: ([\d.]+) sec")


@dataclass
class Job:
    label: str
    args: list[str]
    cache: str | None = None  # "cold" | "warm" | None (no compile)
    env: dict[str, str] = field(default_factory=dict)  # on top of this environment's


@dataclass
class Result:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # user + system, the job's processes
    first_step: list[float] = field(default_factory=list)
    compile_first: list[float] = field(default_factory=list)
    compile_total: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)
    validation: list[float] = field(default_factory=list)  # seconds per epoch's validation
    graphs: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    batch: int = 0


def jobs(config: str, opt_config: str) -> list[Job]:
    return [Job("eager fp32", [f"--config={config}"]),
            Job("eager bf16 + fused + prefetch", [f"--config={config}", "--amp_mode=auto",
                                                   "--enable_fused", "--prefetch_thread"]),
            Job("compiled, cold cache", [f"--config={opt_config}"], "cold"),
            Job("compiled, warm cache", [f"--config={opt_config}"], "warm")]


WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def wait_policy_jobs(config: str) -> list[Job]:
    plan = []
    for extra, what in (([], ""), (["--num_data_workers=1"], ", 1 loader worker")):
        args = [f"--config={config}", *extra]
        plan += [Job(f"default environment{what}", args),
                 Job(f"OMP_WAIT_POLICY=ACTIVE{what}", args, env={"OMP_WAIT_POLICY": "ACTIVE"}),
                 Job(f"OMP_WAIT_POLICY=PASSIVE{what}", args,
                     env={"OMP_WAIT_POLICY": "PASSIVE"})]
    return plan


def run_job(job: Job, num_iters: int, cache_dir: str, into: Result, busy: bool = False
            ) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_job_logs_") as logs:
        env = {k: v for k, v in os.environ.items() if k not in WAIT_KEYS}  # the job's own
        env.update(LOG_DIR=logs, TORCHINDUCTOR_CACHE_DIR=cache_dir, **job.env)
        cmd = [sys.executable, "train.py", *job.args, f"--num_iters={num_iters}"]
        if job.cache is not None:
            cmd.append("--enable_jit")  # already in an _opt config; makes any config compile
        # --busy: another job's busy thread on the same cores, from before the job starts
        other = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        start, cpu = time.perf_counter(), children_cpu()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - start, children_cpu() - cpu
        if other is not None:
            other.kill()
            other.wait()
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        sys.exit(f"error: `{' '.join(cmd)}` exited with {proc.returncode}:\n{out[-3000:]}")
    first = FIRST_STEP.search(out)
    if first is None:
        sys.exit(f"error: `{' '.join(cmd)}` logged no first-step line:\n{out[-3000:]}")
    into.wall.append(wall)
    into.cpu.append(cpu)
    into.first_step.append(float(first.group(1)))
    if first.group(2) is not None:
        into.compile_first.append(float(first.group(2)))
        into.hits.append(int(first.group(4)))
        whole = WHOLE_RUN.search(out)
        into.compile_total.append(float(whole.group(1)))
        into.graphs.append(int(whole.group(2)))
    later = [float(s) for e, s in EPOCH.findall(out) if int(e) > 1]
    if later:
        into.samples_per_s.append(statistics.median(later))
    into.validation += [float(v) for v in VALIDATION.findall(out)]
    into.batch = int(BATCH.search(out).group(1))
    print(f"  {job.label}: {wall:.1f} s wall, {cpu:.1f} s CPU", file=sys.stderr, flush=True)


def children_cpu() -> float:
    """User + system seconds of every finished child process and its descendants (the
    compiler processes Inductor starts included): less sensitive to other jobs than wall
    time on a shared machine."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def med(values: list[float], fmt: str = "{:.1f}") -> str:
    return fmt.format(statistics.median(values)) if values else "-"


def payoff(compile_s: float, eager: Result, compiled: Result) -> str:
    """Steps after which the compiled job has caught up with the eager one."""
    if not (eager.samples_per_s and compiled.samples_per_s):
        return "- (no epoch after the first to time steps in)"
    step_eager = compiled.batch / statistics.median(eager.samples_per_s)
    step_compiled = compiled.batch / statistics.median(compiled.samples_per_s)
    saved = step_eager - step_compiled
    return f"{compile_s / saved:.0f}" if saved > 0 else "no (its steps were not faster)"


def print_table(results: dict[str, Result], num_iters: int, rounds: int) -> None:
    print(f"\njobs of {num_iters} iterations, medians of {rounds} interleaved rounds")
    print("| job | wall [s] | CPU [s] | time to first step [s] | compile before step 1 / "
          "whole run [s] | graphs | cache hits | samples/s (epochs 2+) "
          "| validation [s per epoch] |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in results.items():
        compile_s = (f"{med(r.compile_first)} / {med(r.compile_total)}"
                     if r.compile_first else "-")
        print(f"| {label} | {med(r.wall)} | {med(r.cpu)} | {med(r.first_step)} | {compile_s} | "
              f"{med(r.graphs, '{:.0f}')} | {med(r.hits, '{:.0f}')} | "
              f"{med(r.samples_per_s)} | {med(r.validation, '{:.2f}')} |")
    if "eager bf16 + fused + prefetch" not in results:  # --wait_policy
        print_wait_policy(results)
        return
    eager = results["eager bf16 + fused + prefetch"]
    for label in ("compiled, cold cache", "compiled, warm cache"):
        r = results[label]
        if r.compile_total:
            print(f"{label}: iterations after which compiling pays for itself (compile "
                  f"time / step time saved against eager bf16): "
                  f"{payoff(statistics.median(r.compile_total), eager, r)}")


def print_wait_policy(results: dict[str, Result]) -> None:
    for label, r in results.items():
        group = label.split(", ", 1)[1:]  # "" or "1 loader worker"
        active = results[", ".join(["OMP_WAIT_POLICY=ACTIVE", *group])]
        if r.samples_per_s and active.samples_per_s:
            ratio = statistics.median(r.samples_per_s) / statistics.median(active.samples_per_s)
            print(f"{label}: samples/s {ratio:.3f} x ACTIVE's (medians)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="cpu_short", help="the eager config")
    p.add_argument("--opt_config", default=None, help="the compiled one (default <config>_opt)")
    p.add_argument("--num_iters", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--wait_policy", action="store_true",
                   help="time OpenMP wait policies instead (module docstring)")
    p.add_argument("--busy", action="store_true",
                   help="run every job next to one busy process (a Python loop): a machine "
                   "shared with another job")
    args = p.parse_args(argv)
    from utils.hardware import cpu_name  # after argparse: --help stays fast

    print(f"CPU: {cpu_name()}; load average {os.getloadavg()[0]:.1f} at the start"
          + ("; every job next to one busy process (--busy)" if args.busy else ""))
    plan = (wait_policy_jobs(args.config) if args.wait_policy else
            jobs(args.config, args.opt_config or f"{args.config}_opt"))
    results = {job.label: Result() for job in plan}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="bench_job_cache_") as cache:
            k = r % len(plan) if args.wait_policy else 0  # compile jobs: cold before warm
            for job in plan[k:] + plan[:k]:
                run_job(job, args.num_iters, cache, results[job.label], args.busy)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    print_table(results, args.num_iters, args.rounds)


if __name__ == "__main__":
    main()
