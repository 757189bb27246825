"""Process-wide memory allocator settings for CPU training."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
GLIBC_DEFAULT_THRESHOLD = 128 * 1024
RETAINING_THRESHOLD = 2**31 - 1


def set_malloc_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    """glibc's ``mallopt`` for the two thresholds; False where there is no glibc (or it refuses)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mmap_set = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold))
    trim_set = bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    return mmap_set and trim_set


def retain_freed_memory() -> bool:
    """Keep large freed blocks in glibc's heap instead of returning them to the kernel.

    Every training step allocates and frees logits of batch × length × vocabulary floats (100+ MB).
    By default glibc serves such blocks with mmap and unmaps them on free, so each step pays for
    fresh, zero-filled pages. Raising the mmap and trim thresholds makes the heap reuse them: training
    steps run 1.15x faster on a 2-core CPU (`benchmarks/allocator.py`, `benchmarks/RESULTS.md`).
    Returns whether the settings took effect (glibc on Linux only).
    """
    return set_malloc_thresholds(RETAINING_THRESHOLD, RETAINING_THRESHOLD)
