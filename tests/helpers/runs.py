"""The overrides of the short real runs the tests make. ``conf/debug/smoke.yaml`` holds the settings a
user's smoke run shares with them; the helpers add the corpus, the cache and what a test checks."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]  # the repository: tests/helpers/runs.py is two below it
# What the session's shared smoke run (conftest's smoke_run_dir) adds: no average, short greedy decoding.
SMOKE_RUN_EXTRA = ("checkpoint.average_last=0", "decoding=greedy", "decoding.max_len_offset=3")


def smoke_run(root: Path, cache: Path, *extra: str) -> list[str]:
    """``debug=smoke`` (the tiny model, 12 optimizer steps, validations after steps 6 and 12) on the corpus
    at ``root``, caching its tokenizer in ``cache``."""
    return ["debug=smoke", f"data.root={root}", f"data.cache_dir={cache}", *extra]


def resumable_run(
    root: Path,
    cache: Path,
    *extra: str,
    pairs: int = 200,
    eval_pairs: int = 16,
    log_every: int = 1,
    deterministic: bool = True,
) -> list[str]:
    """A short run whose every random draw a resumed run must repeat: dropout 0.3, greedy decoding, the
    first ``pairs`` training and ``eval_pairs`` evaluation pairs, metrics every ``log_every`` steps,
    ``deterministic`` kernels. Its length and validations are the test's to set."""
    return [
        "model=tiny",
        f"data.root={root}",
        f"data.cache_dir={cache}",
        "data.vocab_size=1000",
        f"data.train_limit={pairs}",
        f"data.eval_limit={eval_pairs}",
        "data.max_tokens=500",
        "logger=none",
        "progress=quiet",
        "decoding=greedy",
        "dashboard.attention_every=0",
        "checkpoint.average_last=0",
        "checkpoint.average_every=null",  # step checkpoints at the validations the test sets
        f"trainer.log_every_n_steps={log_every}",
        f"trainer.deterministic={str(deterministic).lower()}",
        "model.dropout=0.3",  # dropout draws random numbers: the resumed run must draw the same ones
        *extra,
    ]


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of the run folder ``run_dir`` as ``tmp_path/run``, to continue or damage (its lock file left out)."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("run.lock"))
    return copy


def rebased(checkpoint: dict[str, Any], original: Path, here: Path) -> None:
    """The checkpoint trackers' paths of a run's checkpoint moved from ``original`` to ``here``: the run
    as it would be had it been trained in this folder (Lightning restores a tracker whole only when its
    ``dirpath`` is the callback's own)."""
    trackers = [state for name, state in checkpoint["callbacks"].items() if name.startswith("ModelCheckpoint{")]
    assert trackers and all(str(original) in repr(tracker) for tracker in trackers)
    for tracker in trackers:
        for field in ("best_model_path", "kth_best_model_path", "dirpath"):
            tracker[field] = tracker[field].replace(str(original), str(here))
        tracker["best_k_models"] = {k.replace(str(original), str(here)): v for k, v in tracker["best_k_models"].items()}


def exit_status(main: Callable[[], object], argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """A console script's ``main`` run in this process with ``argv`` (the program's name first): its exit
    status, 0 when it returns. Anything but SystemExit escaping it is a traceback the user would see, and
    fails the test."""
    monkeypatch.setattr(sys, "argv", argv)
    try:
        main()
    except SystemExit as stopped:
        return 0 if stopped.code is None else stopped.code
    return 0


def eval_in_process(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    """``aiayn-eval`` run in this process: its exit status and what it printed (stdout, then stderr)."""
    from aiayn.cli import evaluate as evaluate_cli

    status = exit_status(evaluate_cli.main, ["aiayn-eval", *argv], monkeypatch)
    out = capsys.readouterr()
    return status, out.out + out.err


def train_in_process(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """``aiayn-train`` run in this process, without Hydra's logging setup (it would keep handlers on
    pytest's captured streams); its exit status."""
    from aiayn.cli import train as train_cli

    quiet = ["hydra/job_logging=none", "hydra/hydra_logging=none"]
    return exit_status(train_cli.main, ["aiayn-train", *argv, *quiet], monkeypatch)


def refusal(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    """``aiayn-train`` on ``argv``, in this process and in the current folder (a test's own), refusing
    before any work: exit 2, one line on stderr, ``aiayn-train: error: ...``, and no run folder left under
    ./outputs. The line, without its ``aiayn-train: error: ``."""
    assert train_in_process(argv, monkeypatch) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aiayn-train: error: "), lines
    outputs = Path.cwd() / "outputs"
    assert not outputs.exists() or not [path for path in outputs.glob("*/*") if path.is_dir()]  # no run folder
    return lines[0].removeprefix("aiayn-train: error: ")
