"""How many CPUs this process may use."""

from __future__ import annotations

import os


def available_cpus() -> int:
    """The CPUs this process may run on: a SLURM job's or a container's share, not the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS and Windows have no affinity masks
        return os.cpu_count() or 1
