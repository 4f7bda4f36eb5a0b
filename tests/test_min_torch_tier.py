"""`make test-min-torch` keeps MIN_TORCH honest: it installs exactly the PyTorch that
distributed/startup_checks.py names as the oldest supported, CI runs it after the README's
test command, and the multi-process tests it names exist and cover every layout family."""

from __future__ import annotations

import ast
import re
import shlex

from helpers import REPO

from distributed.startup_checks import MIN_TORCH

FAMILIES = ("ddp", "tp2", "cp2", "h2xw2", "fsdp", "recompute", "compile")


def min_torch_tests() -> list[str]:
    text = (REPO / "Makefile").read_text()
    block = re.search(r"^MIN_TORCH_TESTS := \\\n((?:\t.*\n)+)", text, re.M)
    assert block, "no MIN_TORCH_TESTS in the Makefile"
    return shlex.split(block.group(1).replace("\\\n", " "))


def test_the_tier_installs_the_pytorch_that_min_torch_names():
    pins = re.findall(r"^torch==(\S+)", (REPO / "requirements-min-torch.txt").read_text(),
                      re.M)
    assert pins == [".".join(map(str, MIN_TORCH))]


def test_ci_runs_the_readmes_tests_then_the_min_torch_tier_then_earth2studio():
    commands = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
                if line.startswith("make ") and "&" not in line]  # not the background installs
    assert commands == ["make venv", "make test", "make test-min-torch",
                        "make test-earth2studio"]


def test_the_tiers_multi_process_tests_exist_and_cover_every_layout_family():
    ids = min_torch_tests()
    for node in ids:
        path, _, name = node.partition("::")
        assert (REPO / path).is_file(), node
        if name:
            function = name.split("[")[0]
            tree = ast.parse((REPO / path).read_text())
            assert function in {f.name for f in ast.walk(tree)
                                if isinstance(f, ast.FunctionDef)}, node
    covered = " ".join(ids).lower()
    assert all(family in covered for family in FAMILIES), (FAMILIES, ids)
