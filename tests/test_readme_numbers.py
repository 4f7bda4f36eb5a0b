"""Claims of the README and of the pages in docs/ that follow from the configs and the data
generator, checked against them: the steps in a profiled `cpu_short` epoch, the epochs of
the measured long runs, and how to call the venv's Python."""

from __future__ import annotations

import inspect
import re

from helpers import CONFIG_FILE, REPO

from data.synthetic import generate
from utils.config import read_config

README = (REPO / "README.md").read_text()
# The README is the map (each step with one measured number); the measurements are in docs/.
DOCS = {"README.md": README} | {f"docs/{p.name}": p.read_text()
                                for p in sorted((REPO / "docs").glob("*.md"))}


def steps_per_epoch(config: str) -> int:
    """Training steps per epoch of `config` on the default synthetic data set: the loader
    pairs sample t with t + dt inside each year file, stops at limit_nsamples and drops the
    last partial batch."""
    defaults = inspect.signature(generate).parameters
    per_year = defaults["samples_per_year"].default
    years = defaults["train_years"].default
    params = read_config(CONFIG_FILE, config, environ={})
    pairs = years * (per_year - int(params.dt))
    if params.limit_nsamples is not None:
        pairs = min(pairs, int(params.limit_nsamples))
    return pairs // int(params.global_batch_size)


def claims(pattern: str) -> list[tuple[str, tuple[str, ...]]]:
    """(page, groups) of every match of `pattern` in the README and docs/ (a claim may be
    wrapped over two lines)."""
    return [(page, m.groups()) for page, text in DOCS.items()
            for m in re.finditer(pattern, text)]


def test_the_profiled_cpu_short_epoch_has_the_steps_the_docs_say():
    found = claims(r"`cpu_short`,\s+profiled\s+epoch\s+4\s+=\s+(\d+)\s+steps")
    assert "README.md" in {page for page, _ in found}, \
        "the README's profiling step no longer states the steps of its epoch"
    for page, (steps,) in found:
        assert int(steps) == steps_per_epoch("cpu_short") == 15, page


def test_the_epochs_of_the_long_runs_follow_from_the_steps_per_epoch():
    found = claims(r"`(cpu_\w+)`,\s+(\d+)\s+iterations\s+=\s+(\d+)\s+epochs")
    assert "README.md" in {page for page, _ in found}
    assert {config for _, (config, *_) in found} >= {"cpu_base", "cpu_afno"}
    for page, (config, iters, epochs) in found:
        assert int(iters) == read_config(CONFIG_FILE, config, environ={}).num_iters, page
        assert int(iters) / steps_per_epoch(config) == int(epochs), page


def test_the_quickstart_says_how_to_use_the_venv():
    quickstart = README.split("## Quickstart")[1].split("\n## ")[0]
    assert "source .venv/bin/activate" in quickstart
    assert ".venv/bin/python" in quickstart
