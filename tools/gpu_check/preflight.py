"""Before anything is installed or built: does this Python have a PyTorch the project supports,
and does that PyTorch see a GPU? One line and exit 2 when not (`make gpu-check`'s first step).

    python -m tools.gpu_check.preflight        # ok: ... ; or error: ... (exit 2)

Imports the standard library, torch and distributed/startup_checks.py (itself standard
library only): it runs with the site's Python before the project's other dependencies are
there. Everything it reads can be injected, so it is tested without a GPU.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from distributed.startup_checks import (
    MIN_TORCH,
    TESTED_TORCH,
    gpus_missing_problem,
    parse_version,
    torch_version_problem,
)

GUIDE = "docs/gpu_first_run.md"


@dataclass(frozen=True)
class Torch:
    """What preflight reads from a PyTorch (injected in tests)."""

    version: str
    cuda: str | None  # torch.version.cuda: None for a CPU-only build
    devices: int


def read_torch() -> Torch | None:
    """The importable PyTorch, or None. Its import warnings (a site PyTorch without numpy
    says so) stay out of the one line this prints."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch
    except ImportError:
        return None
    return Torch(torch.__version__, torch.version.cuda, torch.cuda.device_count())


def problem(found: Torch | None, environ: dict[str, str] | None = None) -> str | None:
    """The one-line error that stops `make gpu-check`, or None when it can go on."""
    import os

    environ = dict(os.environ) if environ is None else environ
    if found is None:
        need = ".".join(map(str, MIN_TORCH))
        return (f"{sys.executable} has no PyTorch: gpu-check uses the site's own PyTorch "
                f"(>= {need}); load the site's PyTorch module or container, or give its "
                f"interpreter as PY=<python> ({GUIDE})")
    old = torch_version_problem(found.version)
    if old:
        return old
    if found.devices == 0:
        assigned = gpus_missing_problem(environ, 0, found.cuda is None)
        if assigned:
            return assigned
        build = "a CPU-only build" if found.cuda is None else f"CUDA {found.cuda}"
        return (f"no GPU: PyTorch {found.version} ({build}) sees no CUDA device; run make "
                f"gpu-check on a GPU node ({GUIDE})")
    return None


def newer_than_tested(version: str) -> str | None:
    """A warning line for a PyTorch newer than the one the tests run with, else None."""
    try:
        found = parse_version(version)[:2]
    except ValueError:
        return None
    if found <= parse_version(TESTED_TORCH)[:2]:
        return None
    return (f"PyTorch {version} is newer than the tested {TESTED_TORCH}: the checks run; "
            "a failure may be new in this release (report it)")


def main() -> int:
    found = read_torch()
    line = problem(found)
    if line:
        print(f"error: {line}", file=sys.stderr)
        return 2
    assert found is not None
    warning = newer_than_tested(found.version)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"gpu-check: PyTorch {found.version} (CUDA {found.cuda}), {found.devices} GPU(s) "
          f"visible; {sys.executable}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
