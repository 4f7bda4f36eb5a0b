"""`make gpu-check`: the first GPU run, one command on one GPU, with the site's own PyTorch and
without network, in at most 8 minutes (docs/gpu_first_run.md).

    make wheels WHEELS=<folder> [WHEELS_PYTHON=3.12]   # where the package index is reachable
    make gpu-check PY=python3 WHEELS=<folder>          # on the GPU node: installs what PY lacks
    python -m tools.gpu_check                          # the checks themselves

Its parts, in the order they run:
  - `preflight`: the PyTorch of PY (present, not older than MIN_TORCH) and a GPU: otherwise
    one line and exit 2 (stdlib and torch only: it runs before anything is installed);
  - `wheels`: the project's other dependencies, collected into a folder (`make wheels`) and
    installed from it, only those PY lacks, into a venv beside the site's environment
    (stdlib only);
  - `environment`: versions, the GPU, what it supports, the optional parts missing;
  - `checks`: each check a function of the device (eager step = graph replay, compile =
    eager, fp16 overflow, bf16 + fused Adam, recompute = plain, FSDP on one rank, FSDP +
    compile, TF32); those that mean something on a CPU are tested there;
  - `memory`: the planner's estimate against what the GPU allocates, reserves and uses;
  - `ladder`: the `short` config's samples/s and MFU for each tutorial optimisation,
    beside the tutorial's published A100 numbers;
  - `report`: one markdown report and its JSON, to paste into an issue. The start-up,
    every check, memory config and ladder row run through its guard (`run_line`): what
    one raises is its line; the report is written however the run ends.
This package's `__init__` imports nothing: `preflight` and `wheels` run on a bare Python.
"""
