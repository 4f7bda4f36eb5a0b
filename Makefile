# Two commands a user needs: `make train` and `make test`. Both create .venv/ when missing.
# `make train` trains CONFIG (default cpu_quickstart: beats persistence in a couple of minutes);
# `make evaluate` scores the 5-day forecasts of the newest run of CONFIG (inference.py); every
# `make train` is a new run, logs/<CONFIG>/1CPU/00, 01, ... (README: Runs).
# On a GPU node, first `make gpu-check` (one GPU, the site's own PyTorch, about 8 minutes, one
# report to paste; docs/gpu_first_run.md), then `make test-gpu` (tests/gpu, 2-4 GPUs, about 30
# minutes; PY=<python> to use another interpreter, e.g. a container's venv, instead of .venv).
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
UNIT := not distributed and not e2e and not slurm and not gpu and not earth2studio

.PHONY: venv data data-ens train evaluate tutorial test test-fast test-dist test-e2e test-gpu lint bench clean \
	wheels gpu-check test-min-torch venv-earth2studio test-earth2studio

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
# The 25 slowest tests are listed at the end: where the suite's time goes, run by run.
test: venv
	$(PY) -m pytest -q --durations=25 tests

test-fast: venv
	$(PY) -m pytest -q -m "$(UNIT)" tests

test-dist: venv
	$(PY) -m pytest -q -m "distributed and not e2e and not gpu" tests

test-e2e: venv
	$(PY) -m pytest -q -m "e2e and not gpu" tests

# The GPU self-test. Without a visible CUDA device it fails (make test skips it instead).
test-gpu: $(if $(filter $(VENV)/bin/python,$(PY)),venv)
	GPU_TESTS_REQUIRED=1 $(PY) -m pytest -q -rs tests/gpu

# The first GPU run (docs/gpu_first_run.md). Where the package index is reachable,
#   make wheels WHEELS=<folder> [WHEELS_PYTHON=3.12]
# collects the project's dependencies but torch (the site's) and DALI (WHEELS_EXTRA=
# nvidia-dali-cuda120 adds it) as wheels for that Python on manylinux x86_64 (glibc up to
# WHEELS_GLIBC); it runs with PYTHON, which must be Python >= 3.7 with pip >= 20.3 (several
# --platform). On the GPU node, without network,
#   make gpu-check PY=python3 WHEELS=<folder>
# stops in one line if PY's PyTorch is missing or older than MIN_TORCH or sees no GPU
# (exit 2); installs only what PY lacks, from the folder, into GPU_CHECK_ENV (a venv beside
# the site's environment, which may be read-only); then runs the checks on one GPU and
# writes one report (logs/gpu_check/<host>-<time>/report.md and report.json).
WHEELS ?=
WHEELS_PYTHON ?= $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
WHEELS_GLIBC ?= 2.28
WHEELS_REQUIREMENTS ?= requirements.txt
WHEELS_EXTRA ?=
GPU_CHECK_ENV ?= .venv-gpu-check
GPU_CHECK_ARGS ?=

wheels:
	@test -n "$(WHEELS)" || { echo "error: WHEELS is empty: make wheels WHEELS=<folder> [WHEELS_PYTHON=3.12]" >&2; exit 2; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 7))' 2>/dev/null || { echo "error: make wheels needs Python >= 3.7 (with pip >= 20.3), and PYTHON=$(PYTHON) is $$($(PYTHON) --version 2>&1 | head -n 1 | grep Python || echo not found): give one as PYTHON=<python>" >&2; exit 2; }
	$(PYTHON) -m tools.gpu_check.wheels download --wheels $(WHEELS) --python $(WHEELS_PYTHON) \
		--glibc $(WHEELS_GLIBC) --requirements $(WHEELS_REQUIREMENTS) $(if $(WHEELS_EXTRA),--extra $(WHEELS_EXTRA))

gpu-check: $(if $(filter $(VENV)/bin/python,$(PY)),venv)
	@$(PY) -m tools.gpu_check.preflight
	@RUN=$$($(PY) -m tools.gpu_check.wheels install --env $(GPU_CHECK_ENV) \
		--requirements $(WHEELS_REQUIREMENTS) $(if $(WHEELS),--wheels $(WHEELS)) $(if $(WHEELS_EXTRA),--extra $(WHEELS_EXTRA))) \
		&& $$RUN -m tools.gpu_check $(GPU_CHECK_ARGS)

# CI's second tier (.ci/run): the oldest PyTorch this code supports (MIN_TORCH in
# distributed/startup_checks.py, pinned in requirements-min-torch.txt with what it needs)
# in a venv of its own, with the project's other requirements: the unit tier, then one
# multi-process test of each layout family (DDP, tp, cp, h x w, FSDP, recompute, compile
# with FSDP and recompute, fp16 agreement). PyPI's torch==2.7.1 is its CUDA 12.6 build
# (~5 GB installed, about a minute to install; it runs on CPUs); the CPU wheel index,
# download.pytorch.org, would be smaller where it is reachable (CI reaches only PyPI).
MIN_VENV := .venv-min-torch
MIN_PY := $(MIN_VENV)/bin/python
MIN_TORCH_TESTS := \
	tests/test_ddp.py::test_two_ddp_ranks_end_with_the_same_parameters_as_one_process \
	tests/test_comm.py::test_every_group_waits_as_long_as_the_job_says \
	"tests/test_model_parallel_vit.py::test_matches_serial[tp2]" \
	"tests/test_model_parallel_vit.py::test_matches_serial[cp2]" \
	"tests/test_afno.py::test_spatial_model_matches_serial[h2xw2]" \
	"tests/test_fsdp.py::test_fsdp_trains_like_serial_on_every_layout[dp2]" \
	tests/test_fsdp.py::test_validation_runs_a_different_number_of_batches_on_each_rank \
	"tests/test_activation_checkpointing.py::test_recompute_reruns_the_collectives_exactly_and_trains_like_serial[tp2]" \
	tests/test_compile_layouts.py \
	"tests/test_fp16_overflow.py::test_an_overflow_on_one_rank_is_skipped_by_every_rank_like_serial[dp2xtp2-fused_adam]"

$(MIN_VENV)/.installed: requirements-min-torch.txt requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(MIN_VENV)
	$(MIN_PY) -m pip install --quiet --upgrade pip
	cat requirements.txt requirements-dev.txt | grep -v -E '^(-r |torch==)' > $(MIN_VENV)/requirements.txt
	$(MIN_PY) -m pip install --quiet -r requirements-min-torch.txt -r $(MIN_VENV)/requirements.txt
	touch $@

test-min-torch: $(MIN_VENV)/.installed
	$(MIN_PY) -m pytest -q -m "$(UNIT)" tests
	$(MIN_PY) -m pytest -q $(MIN_TORCH_TESTS)

# CI's third tier (.ci/run): NVIDIA's Earth2Studio runs this project's models
# (docs/earth2studio.md). Its venv sees the project's .venv (a .pth file names its
# site-packages): Earth2Studio runs on the very PyTorch the project pins, never a second one
# (requirements.txt's torch line is also a constraint), and what it needs in other versions
# (netCDF4 < 1.7.3) is installed in its own site-packages, which come first. PyPI's
# torchvision (PhysicsNeMo's, through timm) is a CUDA build: beside a CPU-only torch it
# cannot load, and is removed again (the FourCastNet test then imports PhysicsNeMo's AFNO alone).
# The tier trains tiny models, evaluates them with inference.py and runs them in
# Earth2Studio's deterministic and ensemble workflows: the forecasts must be equal.
E2S_VENV := .venv-earth2studio
E2S_PY := $(E2S_VENV)/bin/python

$(E2S_VENV)/.installed: $(VENV)/.installed requirements-earth2studio.txt
	rm -rf $(E2S_VENV)
	$(PY) -m venv $(E2S_VENV)
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
		> $$($(E2S_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/project-venv.pth
	grep -E '^torch==' requirements.txt > $(E2S_VENV)/constraints.txt
	$(E2S_PY) -m pip install --quiet -c $(E2S_VENV)/constraints.txt -r requirements-earth2studio.txt
	$(E2S_PY) -c "import torchvision" 2>/dev/null || { \
		echo "PyPI's torchvision does not load beside this torch: removed"; \
		$(E2S_PY) -m pip uninstall --quiet --yes torchvision; }
	touch $@

venv-earth2studio: $(E2S_VENV)/.installed

test-earth2studio: $(E2S_VENV)/.installed
	EARTH2STUDIO_TESTS_REQUIRED=1 $(E2S_PY) -m pytest -q -rs -m earth2studio tests

lint: venv
	$(VENV)/bin/ruff check .

bench: venv data
	DATA_DIR=$(DATA_DIR) $(PY) -m bench.bench_step --config=cpu_short

clean:
	rm -rf $(VENV) $(DATA_DIR) $(MIN_VENV) $(GPU_CHECK_ENV) $(E2S_VENV)
