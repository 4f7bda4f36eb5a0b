# Two commands a user needs: `make train` and `make test`. Both create .venv/ when missing.
# `make train` trains CONFIG (default cpu_quickstart: beats persistence in a couple of minutes);
# `make evaluate` scores the 5-day forecasts of the newest run of CONFIG (inference.py); every
# `make train` is a new run, logs/<CONFIG>/1CPU/00, 01, ... (README: Runs).
# On a GPU node, `make test-gpu` first (tests/gpu, about 30 minutes; PY=<python> to use another
# interpreter, e.g. a container's venv, instead of .venv).
# While changing code: `make test-fast` (the unit tier, under a minute), then the tier you
# touched: `make test-dist` (several ranks) or `make test-e2e` (scripts run as users run them).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DATA_DIR ?= datasets/synthetic
# The ensembles' data: the same planet with a random kick of z500 RMS FORCING m2/s2 every 6 h.
ENS_DATA_DIR ?= datasets/synthetic_ens
FORCING ?= 100
CONFIG ?= cpu_quickstart

# The unit tier is every test without a tier marker (pyproject.toml lists the markers).
UNIT := not distributed and not e2e and not slurm and not gpu

.PHONY: venv data data-ens train evaluate tutorial test test-fast test-dist test-e2e test-gpu lint bench clean

$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

venv: $(VENV)/.installed

$(DATA_DIR)/stats/time_means.npy: | $(VENV)/.installed
	$(PY) -m data.synthetic --out $(DATA_DIR)

data: $(DATA_DIR)/stats/time_means.npy

$(ENS_DATA_DIR)/stats/time_means.npy: | $(VENV)/.installed
	$(PY) -m data.synthetic --out $(ENS_DATA_DIR) --forcing $(FORCING)

data-ens: $(ENS_DATA_DIR)/stats/time_means.npy

train: venv data
	DATA_DIR=$(DATA_DIR) $(PY) train.py --config=$(CONFIG)

evaluate: venv data
	DATA_DIR=$(DATA_DIR) $(PY) inference.py --config=$(CONFIG)

# The README walked as a newcomer walks it: every CPU command of its steps, as written, in a
# fresh copy; prints each one's exit code, time and what it shows (docs/tutorial_walk.md).
# Meant to fit in half an hour on 2 cores (the last walks' times are in that page); not
# part of `make test`. CPU_CLASS=avx2 (avx512, avx512_bf16, amx): as a CPU of that class
# computes, by capping this one's instruction set (not its speed).
tutorial: venv data
	$(PY) -m tools.tutorial_walk $(if $(CPU_CLASS),--cpu_class $(CPU_CLASS))

# Everything (what CI runs): unit, distributed, e2e and SLURM; tests/gpu skips without CUDA.
test: venv
	$(PY) -m pytest -q tests

test-fast: venv
	$(PY) -m pytest -q -m "$(UNIT)" tests

test-dist: venv
	$(PY) -m pytest -q -m "distributed and not e2e and not gpu" tests

test-e2e: venv
	$(PY) -m pytest -q -m "e2e and not gpu" tests

# The GPU self-test. Without a visible CUDA device it fails (make test skips it instead).
test-gpu: $(if $(filter $(VENV)/bin/python,$(PY)),venv)
	GPU_TESTS_REQUIRED=1 $(PY) -m pytest -q -rs tests/gpu

lint: venv
	$(VENV)/bin/ruff check .

bench: venv data
	DATA_DIR=$(DATA_DIR) $(PY) -m bench.bench_step --config=cpu_short

clean:
	rm -rf $(VENV) $(DATA_DIR)
