"""Walk the README's tutorial as a newcomer would: every CPU command of its steps (Quickstart
to step 14), exactly as the README writes it (tools/readme_commands.py reads them from it), in
order, in a fresh copy of this checkout. Prints a table: the command, its exit status, wall
time (and the time the README states), and whether what the README says to look at appeared
(tools/tutorial_checks.py).

    make tutorial                                   # the same as:
    python -m tools.tutorial_walk                   # <= 30 min on 2 cores
    python -m tools.tutorial_walk --steps 8 12      # some steps only (the later ones may
                                                    # need the runs of earlier ones)
    python -m tools.tutorial_walk --dry_run         # the plan: what runs, what is skipped
    make tutorial CPU_CLASS=avx2                    # as a CPU of that class computes
    python -m tools.tutorial_walk --cpu_class avx2  # (the same)

The copy holds the tracked files of this checkout (uncommitted edits included) and links to
its `.venv` and `datasets`, so no environment or data is rebuilt (a fresh clone's `make
train` would build both first). Commands that need a cluster or a GPU are listed as skipped,
with the reason. `tensorboard` is started, asked for its page, and stopped. Each command's
output is kept in <copy>/tutorial_walk/NN.log; the table (a markdown section headed by the
CPU class, ready for docs/tutorial_walk.md) also goes to <copy>/tutorial_walk/table.md.

`--cpu_class avx2|avx512|avx512_bf16|amx` runs every command under the caps
(`utils.hardware.CLASS_CAPS`) that make this CPU compute in that class's instruction set:
what is emulated and the bf16/fp32 ratio, not that class's clock, cores or fp32 speed. A cap
can only take instructions away: a class above this CPU's is refused.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tools.readme_commands import Command, tutorial_commands
from tools.tutorial_checks import looks
from utils.hardware import CAP_VARS, CLASS_CAPS

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 1800.0


@dataclass
class Result:
    command: Command
    status: str  # exit code, "skipped", "timeout"
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # user + system time of the command and what it started
    load: str = ""  # 1-minute load average when the command ended
    looked: str = ""  # what the README says to look at, and whether it appeared
    ok: bool = True


# ----------------------------------------------------------------- the copy and the runs
def make_copy(dest: Path) -> None:
    """This checkout's tracked files (as they are now) in `dest`, with links to its .venv,
    .venv-earth2studio (step 14's, where it exists) and datasets. The copied requirement
    files get the age of their venv's stamp, so that `make` finds the linked environments up
    to date instead of rebuilding them."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    for shared in (".venv", ".venv-earth2studio", "datasets"):
        if (REPO / shared).exists():
            (dest / shared).symlink_to((REPO / shared).resolve())
    for venv, names in ((".venv", ("requirements.txt", "requirements-dev.txt")),
                        (".venv-earth2studio", ("requirements-earth2studio.txt",))):
        stamp = dest / venv / ".installed"
        if stamp.exists():
            age = stamp.stat().st_mtime - 1
            for name in names:
                os.utime(dest / name, (age, age))


# The README's note for mpirun as root (step 7): Open MPI refuses to start without these.
AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def environment(copy: Path, cpu_class: str | None = None) -> dict[str, str]:
    """A shell with the venv activated (what `source .venv/bin/activate` gives), none of
    the variables that would move the README's paths (LOG_DIR, DATA_DIR), and, as root,
    the two variables the README says mpirun needs then; with `cpu_class`, that class's
    caps in place of any the caller set."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOG_DIR", "DATA_DIR", "PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR")}
    env["VIRTUAL_ENV"] = str(copy / ".venv")
    env["PATH"] = f"{copy / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    if os.geteuid() == 0:
        env.update(AS_ROOT)
    if cpu_class:
        env = {k: v for k, v in env.items() if k not in CAP_VARS} | CLASS_CAPS[cpu_class]
    return env


def run(command: str, copy: Path, log: Path, timeout: float, env: dict[str, str]
        ) -> tuple[str, float]:
    """Run `command` in bash in the copy; (status, seconds). Its output goes to `log`."""
    start = time.monotonic()
    proc = start_logged(command, copy, log, env)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        return "timeout", time.monotonic() - start
    return str(code), time.monotonic() - start


def start_logged(command: str, copy: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    """`command` started in bash in the copy, in a process group of its own (`stop` ends
    all it starts), its output in `log` after the command itself."""
    with open(log, "w") as out:
        out.write(f"$ {command}\n")
        out.flush()
        return subprocess.Popen(["bash", "-c", command], cwd=copy, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """End `proc` and everything it started (its own process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def serve(command: str, copy: Path, log: Path, env: dict[str, str], wait: float = 120.0
          ) -> tuple[str, float, str]:
    """Start a server command (tensorboard), ask for its page, stop it."""
    start = time.monotonic()
    proc = start_logged(command, copy, log, env)
    url = None
    while url is None and time.monotonic() - start < wait and proc.poll() is None:
        time.sleep(1)
        m = re.search(r"(http://\S+:\d+/)", log.read_text())
        url = m.group(1) if m else None
    answer = ""
    if url:
        try:
            with urllib.request.urlopen(url.replace("0.0.0.0", "127.0.0.1"), timeout=30) as r:
                answer = f"served its page ({url}: HTTP {r.status})"
        except OSError as e:
            answer = f"no page at {url} ({e})"
    code = proc.poll()
    stop(proc)
    status = "served" if answer.startswith("served") else str(code)
    return status, time.monotonic() - start, answer or "no URL printed"


def walk(copy: Path, commands: list[Command], timeout: float,
         cpu_class: str | None = None) -> list[Result]:
    """Run `commands` in the copy, in order (under `cpu_class`'s caps, if given)."""
    env = environment(copy, cpu_class)
    results: list[Result] = []
    logs = copy / "tutorial_walk"
    logs.mkdir(exist_ok=True)
    for i, c in enumerate(commands):
        if c.skip:
            results.append(Result(c, "skipped", looked=c.skip))
            continue
        if c.fresh_dir and (copy / c.fresh_dir).exists():  # "in a fresh `logs/...`"
            aside = copy / f"{c.fresh_dir}-before-step-{c.step}"
            (copy / c.fresh_dir).rename(aside)
            c.notes.append(f"moved the earlier {c.fresh_dir} to {aside.name}, as the README "
                           "asks for a fresh one")
        log = logs / f"{i:02d}.log"
        if "mpirun" in c.text.split() and os.geteuid() == 0:
            c.notes.append("as root, with " + " ".join(f"{k}=1" for k in AS_ROOT))
        cpu_before = children_cpu()
        print(f"[{time.strftime('%H:%M:%S')}] step {c.step}: {c.text}", flush=True)
        if c.text.startswith("tensorboard"):
            status, seconds, looked = serve(c.text, copy, log, env)
            result = Result(c, status, seconds, looked=looked, ok=status == "served")
        else:
            status, seconds = run(c.text, copy, log, timeout, env)
            out = log.read_text(errors="replace")
            verdicts = [check(out, copy) for check in looks(c)]
            looked = "; ".join(text for _, text in verdicts)
            result = Result(c, status, seconds, looked=looked or "(exit status)",
                            ok=status == "0" and all(ok for ok, _ in verdicts))
        result.load = open("/proc/loadavg").read().split()[0]
        result.cpu_seconds = children_cpu() - cpu_before
        results.append(result)
        print(f"    -> {result.status} in {result.seconds:.0f} s (load {result.load}); "
              f"{result.looked}", flush=True)
    return results


def children_cpu() -> float:
    """CPU seconds used so far by this process's finished children (and theirs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# ----------------------------------------------------------------- the report
CLASS_PROBE = ("import os, torch; from utils.hardware import cpu_class, cpu_model; "
               "c = cpu_class(); print(c.name); print(f'{cpu_model()}, {os.cpu_count()} CPUs; "
               "torch {torch.__version__}; {c.describe()}')")


def machine(env: dict[str, str] | None = None, cwd: Path = REPO) -> tuple[str, str]:
    """(the CPU class the commands compute in, a line naming the CPU, that class and why,
    the caps, the torch build), asked of a Python started in `env`: caps act when torch
    loads, so only a new process shows them."""
    out = subprocess.run([sys.executable, "-c", CLASS_PROBE], cwd=cwd, env=env, check=True,
                         capture_output=True, text=True).stdout.splitlines()
    return out[0], out[1]


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def table(results: list[Result]) -> str:
    rows = ["| step | command | exit | wall | CPU | README says | load | what to look at |",
            "|---|---|---|---:|---:|---:|---:|---|"]
    for r in results:
        c = r.command
        said = c.stated_seconds
        stated = "" if said is None else duration(said)
        if said and r.seconds > 2 * said and r.status not in ("skipped",):
            stated += " (>2x)"
        wall, cpu = ("", "") if r.status == "skipped" else \
            (duration(r.seconds), duration(r.cpu_seconds))
        looked = r.looked + "".join(f"; {n}" for n in c.notes)
        rows.append(f"| {c.step} | `{c.text}` | {r.status} | {wall} | {cpu} | {stated} | {r.load} "
                    f"| {looked.replace('|', '/')} |")
    return "\n".join(rows)


def summary(results: list[Result], seconds: float, loads: tuple[str, str]) -> str:
    ran = [r for r in results if r.status != "skipped"]
    failed = [r for r in ran if not r.ok]
    cpu = sum(r.cpu_seconds for r in ran)
    return (f"{len(ran)} commands run, {len(results) - len(ran)} skipped, {len(failed)} "
            f"failed or missing what to look at; {duration(seconds)} in all "
            f"({duration(cpu)} of CPU time); load average {loads[0]} at the start, "
            f"{loads[1]} at the end")


def report(cpu: tuple[str, str], results: list[Result], seconds: float,
           loads: tuple[str, str]) -> str:
    """The walk as a section of docs/tutorial_walk.md: headed by the CPU class."""
    return (f"### CPU class {cpu[0]}\n\n{cpu[1]}\n\n{table(results)}\n\n"
            f"{summary(results, seconds, loads)}\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=None,
                   help="where the fresh copy goes (default: a new temporary directory)")
    p.add_argument("--steps", nargs="+", default=None,
                   help="run only these steps (quickstart, 1, ..., 12)")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per command")
    p.add_argument("--dry_run", action="store_true", help="print the plan, run nothing")
    p.add_argument("--cpu_class", choices=sorted(CLASS_CAPS), default=None,
                   help="run every command as a CPU of this class computes (its instruction "
                   "set, not its speed: utils.hardware.CLASS_CAPS); default: this CPU as it is")
    args = p.parse_args(argv)
    commands = tutorial_commands(REPO)
    if args.steps:
        for c in commands:
            if c.step not in args.steps and not c.skip:
                c.skip = "not among --steps"
    if args.dry_run:
        for c in commands:
            print(f"{c.step:>10}  {'skip: ' + c.skip if c.skip else 'run'}: {c.text}")
        return 0
    cpu = machine(environment(REPO, args.cpu_class))
    if args.cpu_class and cpu[0] != args.cpu_class:
        print(f"error: --cpu_class {args.cpu_class}: under its caps this CPU computes as class "
              f"{cpu[0]} ({cpu[1]}); a cap only takes instructions away, so a class this CPU "
              "lacks cannot be reached", file=sys.stderr)
        return 2
    copy = Path(args.workdir or tempfile.mkdtemp(prefix="tutorial-walk-")).resolve()
    copy.mkdir(parents=True, exist_ok=True)
    if any(copy.iterdir()):
        print(f"error: --workdir {copy} is not empty: the walk needs a fresh copy",
              file=sys.stderr)
        return 2
    make_copy(copy)
    print(f"A fresh copy in {copy}; CPU class {cpu[0]}: {cpu[1]}", flush=True)
    load_start = open("/proc/loadavg").read().split()[0]
    start = time.monotonic()
    results = walk(copy, commands, args.timeout, args.cpu_class)
    seconds = time.monotonic() - start
    load_end = open("/proc/loadavg").read().split()[0]
    text = report(cpu, results, seconds, (load_start, load_end))
    (copy / "tutorial_walk" / "table.md").write_text(text)
    print("\n" + text)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
