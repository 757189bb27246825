"""Process-wide memory allocator settings for CPU training."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def retain_freed_memory() -> bool:
    """Keep large freed blocks in glibc's heap instead of returning them to the kernel.

    Every training step allocates and frees logits of batch × length × vocabulary floats (100+ MB).
    By default glibc serves such blocks with mmap and unmaps them on free, so each step pays for
    fresh, zero-filled pages: a quarter of the step time goes to the kernel on a 2-core CPU
    (benchmarks/RESULTS.md). Raising the mmap and trim thresholds makes the heap reuse them.
    Returns whether the settings took effect (glibc on Linux only).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 2**31 - 1)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
