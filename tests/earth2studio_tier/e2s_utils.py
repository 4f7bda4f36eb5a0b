"""Shared pieces of the Earth2Studio tier (tests/earth2studio_tier): the gate, and tiny models
trained, evaluated by inference.py (their forecasts saved) and exported, once per session.

Every test module starts with

    from e2s_utils import require_earth2studio  # noqa: F401  (the fixture below)
    pytestmark = [pytest.mark.earth2studio, pytest.mark.usefixtures("require_earth2studio")]

Without Earth2Studio the tests skip ("needs Earth2Studio: ..."): `make test` runs in the
project's own venv, which does not have it. `make test-earth2studio` runs them in
.venv-earth2studio with EARTH2STUDIO_TESTS_REQUIRED=1: a missing Earth2Studio is a failure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import assert_completed, run_script

REQUIRED = bool(os.environ.get("EARTH2STUDIO_TESTS_REQUIRED"))
INSTALL = "make venv-earth2studio, then .venv-earth2studio/bin/python -m pytest -m earth2studio"

# The forecasts compared: 2 initial conditions of the tiny test year, 6 steps of 6 h each.
INITIAL_CONDITIONS, LEADS = 2, 6
# inference.py and Earth2Studio compute in fp32 with the same kernels; what differs is the
# batching (inference.py rolls out its initial conditions and members together, Earth2Studio
# its own batches) and the physical units the workflow carries from step to step (float32
# rounding of a field's values: ~1e-7 of them). docs/earth2studio.md has the measured differences.
TOLERANCE = 1e-5  # relative (tools/earth2studio/compare.py)


def need(module: str, why: str = "") -> None:
    """Skip without `module`; fail under EARTH2STUDIO_TESTS_REQUIRED."""
    try:
        __import__(module)
    except ImportError as e:
        reason = f"needs {module} ({e}){why}: {INSTALL}"
        if REQUIRED:
            pytest.fail(f"{reason} (EARTH2STUDIO_TESTS_REQUIRED is set)")
        pytest.skip(reason)


@pytest.fixture(scope="session")
def require_earth2studio() -> None:
    """Session-scoped, so that the fixtures that train and export run only where the tests
    do."""
    need("earth2studio.run")


@dataclass(frozen=True)
class Evaluated:
    """A trained tiny model: its run, its package, inference.py's saved forecasts."""

    run_dir: Path
    package: Path
    store: Path


_runs: dict[tuple, Path] = {}
_stores: dict[tuple, Evaluated] = {}


def evaluated(config: str, data_dir: Path, tmp: Path, ensemble_size: int | None = None
              ) -> Evaluated:
    """`config` trained (its 16 iterations), exported, and evaluated by inference.py with
    --save_forecasts (with --ensemble_size if given); each made once per session."""
    from tools.earth2studio.package import export
    from training.checkpoint import latest_checkpoint

    if config not in _runs:
        run = run_script("train.py", [f"--config={config}"], data_dir=data_dir,
                         log_dir=tmp / config / "logs", timeout=600)
        assert_completed(run, 16)
        _runs[config] = next((tmp / config / "logs" / config / "1CPU").iterdir())
    run_dir = _runs[config]
    key = (config, ensemble_size)
    if key not in _stores:
        name = f"forecasts_e{ensemble_size}.zarr" if ensemble_size else "forecasts.zarr"
        flags = ["--run_dir", run_dir, "--n_initial_conditions", INITIAL_CONDITIONS,
                 "--lead_steps", LEADS, "--save_forecasts", run_dir / name,
                 "--out", run_dir / f"forecast_{name}"]
        flags += ["--ensemble_size", ensemble_size] if ensemble_size else []
        done = run_script("inference.py", flags, data_dir=data_dir, log_dir=tmp, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        package = run_dir / "package"
        if not package.exists():
            with pytest.MonkeyPatch.context() as env:  # the run's data, as for inference
                env.setenv("DATA_DIR", str(data_dir))
                export(latest_checkpoint(str(run_dir)), str(package))
        _stores[key] = Evaluated(run_dir, package, run_dir / name)
    return _stores[key]
