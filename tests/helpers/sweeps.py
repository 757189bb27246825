"""Sweep files and runners for the tests of aiayn-sweep: a sweep file of a few lines or one whose trials are
a test's script, the runner in this process (``main()``, where the process is not what a test is about)
or as a terminal starts it (where signals, exit codes of a real process, orphans or re-attaching are),
and ``sweep.json`` read back."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from aiayn.cli import sweep as sweep_cli
from aiayn.experiments.sweeps.state import STATE_FILE

# The smallest sweep aiayn-sweep accepts: one trial, of seed 1.
GRID = "method: grid\nparameters: {seed: {values: [1]}}\ncommand: ['${args_no_hyphens}']\n"


def sweep_file(path: Path, text: str = GRID) -> Path:
    path.write_text(text)
    return path


def script_sweep(folder: Path, script: str, seeds: Sequence[int], *fixed: str, name: str = "s.yaml") -> Path:
    """``folder/<name>``: a grid over ``seeds`` whose trials run ``script`` (Python source, written beside it)
    with the ``fixed`` arguments before the swept ones, and whose metric is ``val/bleu``."""
    program = folder / "trial.py"
    program.write_text(script)
    config = {
        "method": "grid",
        "program": str(program),
        "metric": {"name": "val/bleu", "goal": "maximize"},
        "parameters": {"seed": {"values": list(seeds)}},
        "command": ["${env}", "${interpreter}", "${program}", *fixed, "${args_no_hyphens}"],
    }
    sweep = folder / name
    sweep.write_text(json.dumps(config))  # JSON is YAML
    return sweep


def sweep_main(argv: Sequence[object], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """aiayn-sweep in this process (in the test's working folder): its exit status, stdout and stderr."""
    try:
        sweep_cli.main([str(arg) for arg in argv])
        status = 0
    except SystemExit as stopped:
        status = stopped.code if isinstance(stopped.code, int) else 1
    out, err = capsys.readouterr()
    return status, out, err


def start_runner(sweep: Path, cwd: Path, *args: str) -> subprocess.Popen[str]:
    """aiayn-sweep as a terminal starts it: a process group of its own (the foreground job's)."""
    command = [sys.executable, "-m", "aiayn.cli.sweep", str(sweep), *args]
    return subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def run_runner(sweep: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "aiayn.cli.sweep", str(sweep), *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


def trials(folder: Path) -> list[dict]:
    """The trials ``sweep.json`` in ``folder`` records, as JSON."""
    return json.loads((folder / STATE_FILE).read_text())["trials"]


@contextmanager
def seeded(seed: int = 0) -> Iterator[None]:
    """W&B's sweep engine draws from Python's and numpy's global generators: seeded for the block, their
    states restored after it."""
    python, numpy = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
