"""The CPU `sbatch` block of docs/slurm.md, pasted as it is into a real two-node SLURM cluster.

The block (every tutorial step as one `sbatch` line, under "On a CPU cluster"; the README
gives its first lines and links it) is read from docs/slurm.md and run by bash, line by line,
from a copy of the repository, on a private cluster (tests/slurm_cluster.py) whose node names
(node1, node2) are not host names, with only the variables the page tells a user about: the
generic preset, DATA_DIR (a small synthetic data set at the CPU configs' grid) and LOG_DIR.
Every job must complete with exit 0 and show what its step is about; the preemption job gets
its USR1 now instead of 120 s before a 10-minute limit, as the block's comment says a user
can do.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import (
    REPO,
    generic_job_env,
    preempt_slurm_job,
    slurm_job_output,
    start_slurm_cluster,
)

PAGE = REPO / "docs" / "slurm.md"
MARKER = "<!-- cpu-sbatch-lines"
BASH = shutil.which("bash") or "/bin/bash"
ALL_JOBS_TIMEOUT = 1500  # s for the whole block (measured 9 min with 2 cores at load ~20)


def cpu_block() -> str:
    """The fenced bash block right after the marker comment."""
    text = PAGE.read_text()
    start = text.index(MARKER)
    match = re.compile(r"```bash\n(.*?)```", re.S).search(text, start)
    assert match, f"no ```bash block after {MARKER!r} in {PAGE.name}"
    return match.group(1)


def sbatch_lines(block: str) -> list[str]:
    return [line for line in block.splitlines()
            if "sbatch " in line and not line.lstrip().startswith("#")]


def test_every_cpu_sbatch_line_states_its_layout_and_stays_short():
    """What the issue asks of the lines themselves: explicit nodes and tasks per node, a short
    iteration count for training, one line per tutorial step and the preemption options."""
    lines = sbatch_lines(cpu_block())
    assert len(lines) >= 13, lines
    for line in lines:
        assert re.search(r" -N \d+ --ntasks-per-node=\d+ ", line), line
        assert "--num_iters" in line or "inference.py" in line, line
    text = " ".join(lines)
    for needle in ("--tp=2", "--cp=2", "ENABLE_CUDA_GRAPHS=1", "-N 2 ", "--h_parallel_size=2",
                   "--signal=USR1@", "--requeue", "ENABLE_PROFILING=1", "dali",
                   "inference.py"):
        assert needle in text, f"no CPU sbatch line in {PAGE.name} with {needle}"


# --------------------------------------------------------------------------- on a cluster

def _repo_copy(dest: Path) -> Path:
    """The repository's files without the environment, data, logs or job outputs: the job
    outputs (`%x-%j.out`, in the submit directory) then stay out of the real checkout."""
    anywhere = shutil.ignore_patterns("__pycache__", ".pytest_cache", ".ruff_cache", "*.out")

    def ignore(directory: str, names: list[str]) -> set[str]:
        top = {".venv", ".git", "datasets", "logs"} if Path(directory) == REPO else set()
        return set(anywhere(directory, names)) | (top & set(names))

    shutil.copytree(REPO, dest, ignore=ignore)
    return dest


@pytest.fixture(scope="module")
def cpu_data(tmp_path_factory) -> Path:
    """The CPU configs' grid (64 x 128), few samples: 2 x 72 training, 72 validation and
    72 test samples, enough for cpu_mp's batch of 64 and a 2-day forecast."""
    from data.synthetic import generate

    out = tmp_path_factory.mktemp("cpu_data")
    generate(out, img_size=(64, 128), samples_per_year=72, train_years=2, valid_years=1,
             test_years=1, seed=0)
    return out


def _submitted(jobs_file: Path) -> list[int]:
    """Job ids in submission order, from `sbatch` and `sbatch --parsable` outputs."""
    ids = []
    for line in jobs_file.read_text().splitlines():
        m = re.fullmatch(r"(?:Submitted batch job )?(\d+)(?:;\S+)?", line.strip())
        if m:
            ids.append(int(m.group(1)))
    return ids


def _checks(line: str, out: str, logs: Path) -> None:
    """What the output of the job of one line of the block must show."""
    iters = re.search(r"--num_iters (\d+)", line)
    if iters:
        assert f"Finished {iters.group(1)} iterations" in out, out[-3000:]
    if "ENABLE_PROFILING=1" in line:
        trace = re.search(r"torch.profiler trace written to (\S+)", out)
        assert trace and Path(trace.group(1)).is_file(), out[-3000:]
        assert Path(trace.group(1)).is_relative_to(logs / "cpu_short" / "1CPU")
    if "-N 2 " in line:
        assert "nodes=2" in out and re.search(r"task RANK=1 .* node=1 ", out), out[-3000:]
    if "--signal=USR1" in line:
        stopped = re.search(r"stopped at iteration (\d+)", out)
        resumed = re.search(r"Resumed from \S+: iteration (\d+)", out)
        assert stopped and resumed and stopped.group(1) == resumed.group(1), out[-3000:]
    if "inference.py" in line:
        assert "Forecast skill of" in out and "Wrote skill.csv" in out, out[-3000:]


@pytest.mark.e2e
@pytest.mark.slurm
def test_cpu_sbatch_block_runs_on_two_nodes_whose_names_do_not_resolve(
        cpu_data: Path, tmp_path: Path) -> None:
    block = cpu_block()
    lines = sbatch_lines(block)
    repo = _repo_copy(tmp_path / "repo")
    logs, jobs_file = tmp_path / "logs", tmp_path / "jobs.txt"
    jobs_file.touch()
    cluster = start_slurm_cluster(nodes=2)
    try:
        for node in cluster.node_names:  # the premise: the names are not host names
            assert subprocess.run(["getent", "hosts", node], capture_output=True).returncode
        # The block sources site/generic.sh itself; SITE is what generic_job_env sets too.
        env = generic_job_env(DATA_DIR=str(cpu_data), LOG_DIR=str(logs),
                              JOBS_FILE=str(jobs_file))
        # `sbatch` records each job id; otherwise the block runs exactly as written.
        script = ('sbatch() { local out; out=$(command sbatch "$@") || return; '
                  'printf "%s\\n" "$out"; printf "%s\\n" "$out" >> "$JOBS_FILE"; }\n'
                  "set -e\n" + block)
        r = cluster.run([BASH, "-c", script], check=False, env=env, cwd=str(repo), timeout=120)
        assert r.returncode == 0, f"the block failed:\n{r.stdout}\n{r.stderr}"
        jobs = _submitted(jobs_file)
        assert len(jobs) == len(lines), (jobs, r.stdout, r.stderr)
        by_line = dict(zip(lines, jobs, strict=True))
        # The preemption job first, while it trains: USR1 now, not 120 s before its limit.
        preempt = next(line for line in lines if "--signal=USR1" in line)
        outputs = {preempt: preempt_slurm_job(cluster, by_line[preempt], ALL_JOBS_TIMEOUT)[0]}
        for line, job in by_line.items():
            if line not in outputs:
                outputs[line] = slurm_job_output(cluster, job, ALL_JOBS_TIMEOUT)
    finally:
        cluster.stop()
    for line, out in outputs.items():
        _checks(line, out, logs)
    # One run, one directory: the six cpu_short training jobs wrote six run directories.
    runs = [d for d in (logs / "cpu_short" / "1CPU").iterdir() if d.is_dir()]
    assert len(runs) == sum(1 for line in lines
                            if "--config=cpu_short " in line and "inference" not in line), runs
