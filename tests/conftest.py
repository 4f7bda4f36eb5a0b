"""Shared fixtures: a tiny synthetic data set and a helper that runs a train script.

    def test_something(tiny_data, run_train):
        rc, out = run_train("train.py", ["--config=tiny", "--num_iters=8"])
        rc, out = run_train("train_mp.py", ["--config=tiny", "--tp=2"], nproc=2)

`run_train` returns a `TrainRun`; it unpacks to (returncode, stdout + stderr) and also keeps
`stdout`, `stderr`, `log_dir` and `data_dir` for tests that need them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CONFIG_FILE = REPO / "config" / "ViT.yaml"

# The tiny data set: 16x32 grid (the `tiny` config's img_size), 24 samples per "year".
TINY_IMG_SIZE = (16, 32)
TINY_SAMPLES_PER_YEAR = 24
TINY_YEARS = {"train": 2, "valid": 1, "test": 1}

# Variables a launcher sets; stripped from a child's environment so that a test started
# inside some job (or by torchrun) never joins it by accident.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
_LAUNCHER_PREFIXES = ("OMPI_COMM_WORLD_", "PMI_", "SLURM_")


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TrainRun:
    returncode: int
    stdout: str
    stderr: str
    log_dir: Path
    data_dir: Path
    cmd: list[str]

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def __iter__(self) -> Iterator:
        """`rc, out = run_train(...)`."""
        return iter((self.returncode, self.output))

    def exp_dir(self, config: str, world_size: int = 1, run_num: str = "00",
                kind: str = "CPU") -> Path:
        """<LOG_DIR>/<config>/<N><CPU|GPU>/<run_num>, where train.py writes its run."""
        return self.log_dir / config / f"{world_size}{kind}" / run_num


def child_env(env_extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and not k.startswith(_LAUNCHER_PREFIXES)}
    # Tests share a couple of cores: one thread per process avoids oversubscription.
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["DIST_TIMEOUT_SEC"] = "120"  # a dead rank fails the test instead of hanging it
    env.update({k: str(v) for k, v in (env_extra or {}).items()})
    return env


def run_script(script: str | os.PathLike, args: Sequence[str] = (), *, data_dir: Path,
               log_dir: Path, env_extra: Mapping[str, str] | None = None,
               cwd: str | os.PathLike = REPO, timeout: float = 300,
               nproc: int | None = None) -> TrainRun:
    """Run `script` (relative to cwd) with `sys.executable`, DATA_DIR and LOG_DIR set;
    with `nproc`, launch it via `python -m torch.distributed.run` on a free port."""
    if nproc is None:
        cmd = [sys.executable, str(script)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script)]
    cmd += [str(a) for a in args]
    env = child_env({"DATA_DIR": str(data_dir), "LOG_DIR": str(log_dir), **(env_extra or {})})
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s\n{out}\n{err}")
    # Every ending of every script run here leaves torch.distributed cleanly (utils.comm).
    assert "outlived comm.shutdown()" not in proc.stdout + proc.stderr, proc.stdout[-3000:]
    return TrainRun(proc.returncode, proc.stdout, proc.stderr, Path(log_dir), Path(data_dir),
                    cmd)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny synthetic data set (16x32, 24 samples per year; 2 train, 1 valid, 1 test
    year) in the ERA5 layout: <dir>/{train,valid,test}/<year>.h5 and <dir>/stats/*.npy."""
    from utils.data.synthetic import generate

    out = tmp_path_factory.mktemp("tiny_data")
    generate(out, img_size=TINY_IMG_SIZE, samples_per_year=TINY_SAMPLES_PER_YEAR,
             train_years=TINY_YEARS["train"], valid_years=TINY_YEARS["valid"],
             test_years=TINY_YEARS["test"], seed=0)
    return out


@pytest.fixture
def tiny_params(tiny_data: Path):
    """The `tiny` config pointed at `tiny_data`, with a local batch size: a fresh YParams."""
    from utils.YParams import YParams

    params = YParams(CONFIG_FILE, "tiny", environ={"DATA_DIR": str(tiny_data)})
    params.local_batch_size = params.global_batch_size
    return params


@pytest.fixture
def run_train(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """`run_train(script, args=(), env_extra=None, cwd=REPO, timeout=300, nproc=None,
    data_dir=tiny_data, log_dir=<fresh tmp dir>) -> TrainRun`."""

    def _run(script: str | os.PathLike, args: Sequence[str] = (),
             env_extra: Mapping[str, str] | None = None, cwd: str | os.PathLike = REPO,
             timeout: float = 300, nproc: int | None = None,
             data_dir: str | os.PathLike | None = None,
             log_dir: str | os.PathLike | None = None) -> TrainRun:
        return run_script(script, args, data_dir=Path(data_dir or tiny_data),
                          log_dir=Path(log_dir or tmp_path_factory.mktemp("logs")),
                          env_extra=env_extra, cwd=cwd, timeout=timeout, nproc=nproc)

    return _run


def slurm_job_output(cluster, job: int, timeout: float) -> str:
    """The output of SLURM `job` once it has COMPLETED with exit 0; otherwise the test fails
    with the job's output and the SLURM daemons' logs."""
    try:
        state, code = cluster.wait(job, timeout=timeout)
    except TimeoutError as e:
        pytest.fail(f"{e}\n--- job output\n{cluster.output(job)[-4000:]}")
    out = cluster.output(job)
    assert (state, code) == ("COMPLETED", 0), \
        f"job {job}: {state} exit {code}\n--- job output\n{out[-4000:]}\n" \
        f"--- daemons\n{cluster.daemon_logs(10)}"
    return out


def start_slurm_cluster(nodes: int = 1):
    """A private SLURM cluster on this machine (tests/slurm_cluster.py), or a visible skip
    where it cannot run (not root, no packages): in the -ra summary, as a warning and on
    stderr. SLURM_TESTS_REQUIRED=1 turns the skip into a failure."""
    import warnings

    from slurm_cluster import ClusterUnavailable, SlurmCluster

    try:
        return SlurmCluster(nodes=nodes).start()
    except ClusterUnavailable as e:
        reason = f"no SLURM cluster on this machine: {e}"
        if os.environ.get("SLURM_TESTS_REQUIRED"):
            pytest.fail(reason + " (SLURM_TESTS_REQUIRED is set)")
        print(f"\nSKIPPED SLURM tests: {reason}", file=sys.stderr)
        warnings.warn(reason, stacklevel=2)
        pytest.skip(reason)
