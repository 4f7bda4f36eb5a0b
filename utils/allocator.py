"""Keep the memory a training step frees inside the process (glibc malloc settings).

By default glibc hands large blocks (>= 128 KiB, adapting up to 32 MiB) straight to the
operating system when they are freed, and trims the top of the heap. A training step frees
its activations, gradients and the last batch every step, so the next step gets fresh
pages from the kernel, each zero-filled on first touch: tens of thousands of page faults a
step, a tenth of a CPU step's time (docs/benchmarks.md). Keeping freed blocks for reuse is
what PyTorch's CUDA allocator does on a GPU, and what tcmalloc/jemalloc do when preloaded.

The train scripts and benchmarks call `keep_freed_memory()` once at start-up. Any MALLOC_*
environment variable means you tune malloc yourself: then nothing is changed. Elsewhere than
glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3


def keep_freed_memory(mmap_threshold: int = 64 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Blocks below `mmap_threshold` bytes come from (and return to) the heap, which is
    trimmed only above `trim_threshold` free bytes. True if glibc accepted both."""
    if any(key.startswith("MALLOC_") for key in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and \
        bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
