"""How a real ``aiayn-train`` process stops: Ctrl-C saves like SIGTERM and says how to continue; after
SIGKILL the CSV holds every metric the last checkpoint has seen; a data error under DDP ends in one line,
not a hang; a full disk is an I/O error with its own status; the console carries no library noise."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from aiayn.cli.common import IO_ERROR_STATUS
from helpers.runs import smoke_run

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def recorder(folder: Path, pause: float) -> str:
    return f"callbacks=[{{_target_:helpers.batch_recorder.BatchRecorder,folder:'{folder}',pause:{pause}}}]"


def start(cwd: Path, *overrides: str) -> subprocess.Popen[str]:
    """``aiayn-train`` in its own session, as a terminal's foreground job is its own process group."""
    command = [sys.executable, "-m", "aiayn.cli.train", *overrides]
    return subprocess.Popen(
        command, cwd=cwd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def wait_until(condition: object, process: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + 300
    while not condition():  # type: ignore[operator]
        assert process.poll() is None, f"the run ended before {what}: {process.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.05)


def batches(folder: Path) -> int:
    path = folder / "batches.rank0.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def rows(run_dir: Path, key: str) -> list[int]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as metrics:
        return [int(row["step"]) for row in csv.DictReader(metrics) if row.get(key)]


@pytest.mark.parametrize("named", [True, False], ids=["hydra.run.dir", "fresh folder"])
def test_ctrl_c_saves_stops_with_130_and_says_how_to_continue(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, named: bool
) -> None:
    overrides = [*smoke_run(corpus_root, cache_dir), recorder(tmp_path / "batches", 0.4)]
    where = [f"hydra.run.dir={tmp_path / 'run'}"] if named else []
    process = start(tmp_path, *overrides, *where)
    wait_until(lambda: batches(tmp_path / "batches") >= 3, process, "third batch")
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C at the terminal does
    _, err = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGINT, err[-3000:]
    message = err.strip().splitlines()[-1]
    assert message.startswith("aiayn-train: stopped: SIGINT received: stopped after step "), message
    run_dir = tmp_path / "run" if named else next((tmp_path / "outputs").glob("*/*"))
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 3 <= saved < 12
    advice = "continue it with the same command" + ("" if named else f" plus hydra.run.dir={run_dir}")
    assert message.endswith(advice)

    again = start(tmp_path, *smoke_run(corpus_root, cache_dir), f"hydra.run.dir={run_dir}")
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 12
    assert "exists and is not empty" not in err  # continuing into its own checkpoints is no news
    assert rows(run_dir, "val/bleu") == [5, 11, 12]  # Lightning's steps: validations after 6 and 12, the best's


def test_after_sigkill_the_csv_holds_what_the_last_checkpoint_has_seen(
    tmp_path: Path, corpus_root: Path, cache_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    overrides = [*smoke_run(corpus_root, cache_dir), f"hydra.run.dir={run_dir}"]
    process = start(tmp_path, *overrides, recorder(tmp_path / "batches", 0.5))
    last = run_dir / "checkpoints" / "last.ckpt"
    wait_until(lambda: batches(tmp_path / "batches") >= 8 and last.is_file(), process, "checkpoint at step 6")
    process.kill()
    process.wait(timeout=60)
    assert torch.load(last, weights_only=True)["global_step"] == 6
    assert rows(run_dir, "val/bleu") == [5]  # the validation the checkpoint holds (Lightning's step 5)
    logged = rows(run_dir, "train/loss")

    again = start(tmp_path, *overrides)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    assert rows(run_dir, "val/bleu") == [5, 11, 12]
    assert rows(run_dir, "train/loss")[: len(logged)] == logged == [1, 3, 5]
    assert rows(run_dir, "train/loss") == [1, 3, 5, 7, 9, 11]


def test_a_data_error_under_ddp_ends_in_one_line_without_a_hang(
    tmp_path: Path, corpus_root: Path, cache_dir: Path
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for path in corpus_root.iterdir():
        text = path.read_text()
        if path.name == "train.de":
            text = "".join(text.splitlines(keepends=True)[:-3])  # three sentences short
        (corpus / path.name).write_text(text)
    process = start(tmp_path, "hardware=cpu_ddp", *smoke_run(corpus, tmp_path / "cache"))
    _, err = process.communicate(timeout=240)  # a rank waiting for the other in a barrier would hang here
    assert process.returncode == 2, err[-3000:]
    (line,) = err.strip().splitlines()
    assert line.startswith("aiayn-train: error: ") and "train.de" in line


def test_a_full_disk_is_reported_in_one_line_with_its_own_status(
    tmp_path: Path, corpus_root: Path, cache_dir: Path
) -> None:
    """The first checkpoint write meets ENOSPC (simulated: mounting a small tmpfs needs privileges)."""
    full = (
        "import errno, sys, torch\n"
        "def no_space(*args, **kwargs):\n"
        "    raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "torch.save = no_space\n"
        "from aiayn.cli.train import main\n"
        "sys.argv = ['aiayn-train', *sys.argv[1:]]\n"
        "main()\n"
    )
    run_dir = tmp_path / "run"
    command = [sys.executable, "-c", full, *smoke_run(corpus_root, cache_dir), f"hydra.run.dir={run_dir}"]
    done = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == IO_ERROR_STATUS, done.stderr[-3000:]
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("aiayn-train: I/O error: [Errno 28] No space left on device (an input/output error")
    assert not list((run_dir / "checkpoints").glob("*.ckpt"))  # no partial checkpoint in place


@pytest.mark.usefixtures("wandb_offline")
def test_a_default_run_prints_no_library_noise(tmp_path: Path, corpus_root: Path, cache_dir: Path) -> None:
    process = start(tmp_path, *smoke_run(corpus_root, cache_dir), "logger=wandb", "progress=quiet")
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    for noise in ("litlogger", "LeafSpec", "anonymous setting", "Traceback"):
        assert noise not in err, noise
