"""The import layers hold: planning > training > evaluation > distributed > networks > data >
utils, no module imports a script, benchmark, tool or the offline ERA5 preparation (era5/,
which imports only data and utils), and the networks read no process groups (import-linter
contracts in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("lint-imports not found: install requirements-dev.txt (import-linter)")
    return subprocess.run([exe, "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_the_tree_keeps_every_import_contract() -> None:
    proc = lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "broken" in proc.stdout and "0 broken" in proc.stdout


def test_a_utils_module_importing_a_model_breaks_the_contract(tmp_path: Path) -> None:
    """The check has teeth: the same contracts on a copy of the tree with one bad import."""
    for name in ("pyproject.toml", "utils", "data", "era5", "networks", "distributed", "evaluation",
                 "training", "planning", "bench", "tools"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, tmp_path / name)
    (tmp_path / "utils" / "bad.py").write_text("from networks.vit import VisionTransformer\n")
    # a run asking the planner, which builds runs: upward too
    (tmp_path / "training" / "bad.py").write_text("from planning.layouts import layouts\n")
    # the data pipeline reaching into the offline preparation
    (tmp_path / "data" / "bad.py").write_text("from era5.writer import prepare_year\n")
    proc = lint_imports(tmp_path)
    assert proc.returncode != 0
    assert "utils.bad -> networks.vit" in proc.stdout, proc.stdout[-3000:]
    assert "training.bad -> planning.layouts" in proc.stdout, proc.stdout[-3000:]
    assert "data.bad -> era5.writer" in proc.stdout, proc.stdout[-3000:]
