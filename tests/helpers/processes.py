"""Real ``aiayn-train`` processes for the tests whose subject is a process: its signals, exit status,
console, locks or DDP ranks. Everything else runs in the test's own process
(:func:`helpers.runs.train_in_process`)."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from helpers.batch_recorder import HELD, RELEASE

TESTS = Path(__file__).resolve().parents[1]
TIMEOUT = 600


def environment() -> dict[str, str]:
    """This process's environment (as the test's fixtures set it), with the tests' callbacks importable."""
    paths = [str(TESTS), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def train_command(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "aiayn.cli.train", *overrides]


def start(*overrides: str, cwd: Path | None = None, own_session: bool = False) -> subprocess.Popen[str]:
    """``aiayn-train`` with ``overrides``; its stderr is a pipe. ``own_session``: in a process group of its
    own, as a terminal's foreground job is."""
    return subprocess.Popen(
        train_command(*overrides),
        cwd=cwd,
        env=environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=own_session,
    )


def finish(*overrides: str, cwd: Path | None = None) -> str:
    """Run ``aiayn-train`` to its end, which must be a success; its stderr."""
    done = subprocess.run(
        train_command(*overrides), cwd=cwd, env=environment(), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


def wait_until(condition: Callable[[], bool], process: subprocess.Popen[str], what: str) -> None:
    """Until ``condition`` holds; the test fails when ``process`` (a run, a sweep runner) ends first."""
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert process.poll() is None, f"the process ended before {what}: {process.communicate()}"
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.01)


def hold_and_signal(process: subprocess.Popen[str], folder: Path, signum: int, group: bool = False) -> int:
    """Once the run's recorder (``recorder(folder, hold_at=N)``) holds after its N-th batch, send
    ``signum`` (to the process group with ``group``), then release the run; the step it was held at."""
    wait_until((folder / HELD).is_file, process, "the held batch")
    if group:
        os.killpg(process.pid, signum)
    else:
        process.send_signal(signum)
    (folder / RELEASE).touch()
    return int((folder / HELD).read_text())


def stopped(process: subprocess.Popen[str], signum: int) -> str:
    """Wait for a run stopped by ``signum``: it must exit as a shell reports it (128 + signal); its stderr."""
    _, err = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 128 + signum, err[-3000:]
    return err


def killed(process: subprocess.Popen[str]) -> None:
    process.kill()  # SIGKILL: no handler runs, nothing is saved
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


def saved_step(run_dir: Path) -> int:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]


def assert_same_weights(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def metric_rows(run_dir: Path, skip: tuple[str, ...] = ()) -> list[dict[str, str]]:
    """The rows of the run's metrics CSV, each without empty cells and without the columns ending in ``skip``."""
    with open(run_dir / "csv" / "metrics.csv", newline="") as rows:
        return [
            {key: value for key, value in row.items() if value and not key.endswith(skip)}
            for row in csv.DictReader(rows)
        ]


def logged_steps(run_dir: Path, key: str) -> list[int]:
    """The (Lightning) steps of the rows that logged ``key``."""
    return [int(row["step"]) for row in metric_rows(run_dir) if key in row]
