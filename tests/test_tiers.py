"""The test suite's own rules (tests/README.md): a test that starts processes carries its
tier's marker, `make test-fast` leaves out every marked tier, and test modules share code
through helpers.py only (never by importing conftest.py or one another)."""

from __future__ import annotations

import ast
import re

import helpers
import pytest
from helpers import REPO, child_env, run_distributed, start_slurm_cluster

TESTS = REPO / "tests"


def _never_called() -> None:
    raise AssertionError("the tier check must stop the test before any rank starts")


@pytest.mark.parametrize("start, marker", [
    (lambda: run_distributed(_never_called, 2), "distributed"),
    (lambda: child_env(), "e2e"),
    (lambda: start_slurm_cluster(), "slurm"),
], ids=["run_distributed", "child_env", "start_slurm_cluster"])
def test_an_unmarked_test_that_starts_processes_fails_and_names_the_marker(start, marker):
    assert helpers.running_test is not None, "conftest.py did not record the running test"
    with pytest.raises(pytest.fail.Exception) as e:
        start()
    assert f"@pytest.mark.{marker}" in str(e.value)
    assert "test_an_unmarked_test_that_starts_processes_fails" in str(e.value)


def test_make_test_fast_leaves_out_every_registered_tier():
    pyproject = (REPO / "pyproject.toml").read_text()
    markers = re.search(r"^markers = \[\n(.*?)^\]", pyproject, re.MULTILINE | re.DOTALL)
    assert markers, "no markers = [...] in pyproject.toml"
    tiers = set(re.findall(r'^\s*"(\w+):', markers.group(1), re.MULTILINE))
    assert {"distributed", "e2e", "slurm", "gpu"} <= tiers
    unit = re.search(r"^UNIT := (.*)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert unit, "no UNIT := ... line in the Makefile"
    assert set(unit.group(1).split(" and ")) == {f"not {tier}" for tier in tiers}


def _imported_modules(path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_test_modules_import_helpers_not_conftest_or_each_other():
    offenders = {}
    for path in sorted(TESTS.rglob("*.py")):
        bad = {name for name in _imported_modules(path)
               if name == "conftest" or name.startswith("test_")}
        if bad:
            offenders[str(path.relative_to(REPO))] = sorted(bad)
    assert not offenders, f"import shared code from helpers.py instead: {offenders}"
