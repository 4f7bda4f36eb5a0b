"""Where torch.compile keeps what it compiled, so that a config pays for compiling once,
not once per job.

Inductor's on-disk caches (the FX graph cache of compiled kernels and the AOTAutograd cache
of forward/backward graphs; on a GPU the Triton kernels are bundled into the former) live in
`TORCHINDUCTOR_CACHE_DIR`. PyTorch's default is a directory under /tmp, which a cluster node
wipes or never shares, so every job would compile from scratch. Unless the user or the site
preset already chose a directory, a run uses `<log root>/torch_compile_cache`: on the shared
file system, the same for every rank and every later job. Dynamo's Python-bytecode tracing
is not cached; that part is paid by every job.
"""

from __future__ import annotations

import os

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
CACHE_SUBDIR = "torch_compile_cache"


def use_compile_cache(expdir: str) -> str:
    """Point Inductor's caches at `<expdir>/torch_compile_cache` unless TORCHINDUCTOR_CACHE_DIR
    is set; returns the directory in use. Must run before anything asks Inductor for its
    cache directory: the first `torch.compile`, and (PyTorch 2.13) constructing DDP. Inductor
    then sets the variable to its /tmp default, and every later caller keeps that."""
    if not os.environ.get(CACHE_ENV):
        os.environ[CACHE_ENV] = os.path.abspath(os.path.join(expdir, CACHE_SUBDIR))
    return os.environ[CACHE_ENV]
