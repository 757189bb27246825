"""The encoding and BPE-dropout workers end when their pool ends, whatever signal handlers the training
process had when it forked them (Lightning's SIGTERM handler notes the signal and carries on: a worker
that inherited it never ended, and training hung at the end of an epoch's BPE-dropout draw)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.runs import REPO

# A process that, like a Lightning fit, handles SIGTERM by noting it, then draws from worker pools many
# times: one job for two workers leaves a worker waiting for its next job when the pool ends it.
POOLS = """
import signal
from aiayn.data.encoding import in_workers
noted = []
signal.signal(signal.SIGTERM, lambda signum, frame: noted.append(signum))
for _ in range(200):
    assert list(in_workers(abs, [-1], 2, lambda: None, ())) == [1]
print("pools ended", len(noted))
"""


@pytest.mark.slow
def test_worker_pools_end_in_a_process_that_handles_sigterm() -> None:
    done = subprocess.run(
        [sys.executable, "-c", POOLS], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert (done.returncode, done.stdout.strip()) == (0, "pools ended 0"), done.stderr[-2000:]
