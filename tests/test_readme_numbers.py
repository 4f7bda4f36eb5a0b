"""Claims of the README that follow from the configs and the data generator, checked
against them: the steps in a `cpu_short` epoch, and how to call the venv's Python."""

from __future__ import annotations

import inspect
import re

from helpers import CONFIG_FILE, REPO

from utils.config import read_config
from utils.data.synthetic import generate

README = (REPO / "README.md").read_text()


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


def test_the_profiled_cpu_short_epoch_has_the_steps_the_readme_says():
    claimed = re.search(r"`cpu_short`,\s+profiled epoch 4 = (\d+) steps", README)
    assert claimed, "the profiling section no longer states the steps of its epoch"
    assert int(claimed.group(1)) == steps_per_epoch("cpu_short") == 15


def test_cpu_base_epochs_in_the_readme_follow_from_the_steps_per_epoch():
    claimed = re.search(r"`cpu_base`, (\d+) iterations = (\d+) epochs", README)
    assert claimed
    iters, epochs = (int(g) for g in claimed.groups())
    assert iters == read_config(CONFIG_FILE, "cpu_base", environ={}).num_iters
    assert iters / steps_per_epoch("cpu_base") == epochs


def test_the_quickstart_says_how_to_use_the_venv():
    quickstart = README.split("## Quickstart")[1].split("\n## ")[0]
    assert "source .venv/bin/activate" in quickstart
    assert ".venv/bin/python" in quickstart
