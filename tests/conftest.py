"""Shared fixtures, and the tier check. Everything else the tests share is in helpers.py.

    def test_something(tiny_data, run_train):      # @pytest.mark.e2e: it runs a script
        rc, out = run_train("train.py", ["--config=tiny", "--num_iters=8"])
        rc, out = run_train("train_mp.py", ["--config=tiny", "--tp=2"], nproc=2)

`run_train` returns a `helpers.TrainRun`; it unpacks to (returncode, stdout + stderr) and
also keeps `stdout`, `stderr`, `log_dir` and `data_dir` for tests that need them.

Tiers (tests/README.md): unit tests are unmarked and run in this process; `distributed`
tests start ranks (helpers.run_distributed), `e2e` tests start Python programs or launchers,
`slurm` tests a SLURM cluster, `gpu` tests need CUDA. helpers' process starters fail a test
that lacks its tier's marker; a test asking for a fixture below that runs scripts fails at
collection.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

# The tests' arrays are tiny: on a couple of shared cores, BLAS and torch's intra-op threads
# only add waiting (a tiny ViT step measured 100x slower with 2 threads than with 1 on a busy
# 2-core machine; a numpy least-squares fit 5x). Set before numpy and torch are imported;
# the children of e2e tests get the same from helpers.child_env.
os.environ["OMP_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = "1"

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import helpers  # noqa: E402  (after the path set-up: helpers' lazy imports need the repo)
import torch  # noqa: E402
from helpers import (  # noqa: E402
    CONFIG_FILE,
    REFERENCE_ARGS,
    TINY_IMG_SIZE,
    TINY_ITERS,
    TINY_SAMPLES_PER_YEAR,
    TINY_YEARS,
    TrainRun,
    assert_completed,
    run_script,
)

torch.set_num_threads(1)  # also where a pytest plugin imported torch before this file

# Fixtures that run scripts, and the marker a test using them must carry.
FIXTURE_TIERS = {"run_train": "e2e", "reference_run": "e2e", "serial_reference": "e2e"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [f"{item.nodeid} uses fixture {name}: mark it @pytest.mark.{tier}"
                for item in items
                for name, tier in FIXTURE_TIERS.items()
                if name in getattr(item, "fixturenames", ()) and not item.get_closest_marker(tier)]
    if unmarked:
        raise pytest.UsageError("tests without their tier's marker:\n  " + "\n  ".join(unmarked))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the test's fixtures: helpers' process starters check its markers."""
    helpers.running_test = (item.nodeid, {m.name for m in item.iter_markers()})


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny synthetic data set (16x32, 24 samples per year; 2 train, 1 valid, 1 test
    year) in the ERA5 layout: <dir>/{train,valid,test}/<year>.h5 and <dir>/stats/*.npy."""
    from data.synthetic import generate

    out = tmp_path_factory.mktemp("tiny_data")
    generate(out, img_size=TINY_IMG_SIZE, samples_per_year=TINY_SAMPLES_PER_YEAR,
             train_years=TINY_YEARS["train"], valid_years=TINY_YEARS["valid"],
             test_years=TINY_YEARS["test"], seed=0)
    return out


@pytest.fixture(scope="module")
def cluster():
    """A private one-node SLURM cluster shared by a module's tests (a module that needs two
    nodes defines its own `cluster`); a visible skip where none can run here."""
    c = helpers.start_slurm_cluster(nodes=1)
    yield c
    c.stop()


@pytest.fixture
def tiny_params(tiny_data: Path):
    """The `tiny` config pointed at `tiny_data`, with a local batch size (frozen: a test
    changes it with `tiny_params.replace(key=value)`)."""
    from utils.config import read_config

    cfg = read_config(CONFIG_FILE, "tiny", environ={"DATA_DIR": str(tiny_data)})
    return cfg.replace(local_batch_size=cfg.global_batch_size)


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


_references: dict[tuple, TrainRun] = {}


@pytest.fixture(scope="session")
def reference_run(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Callable[..., TrainRun]:
    """`reference_run(script="train.py", args=REFERENCE_ARGS, nproc=None) -> TrainRun`:
    an uninterrupted run, made once per session (also from a background thread) and shared
    by every test file that compares with it: the DDP, model-parallel, mpirun, resume and
    preemption tests."""

    def _reference(script: str = "train.py", args: Sequence[str] = REFERENCE_ARGS,
                   nproc: int | None = None) -> TrainRun:
        key = (script, tuple(args), nproc)
        if key not in _references:
            run = run_script(script, args, data_dir=tiny_data, nproc=nproc, timeout=240,
                             log_dir=tmp_path_factory.mktemp("reference"))
            assert_completed(run, TINY_ITERS)
            _references[key] = run
        return _references[key]

    return _reference


@pytest.fixture(scope="session")
def serial_reference(reference_run) -> TrainRun:
    """train.py on one process, global batch 4, 16 iterations: the curve every parallel
    layout must reproduce."""
    return reference_run("train.py")
