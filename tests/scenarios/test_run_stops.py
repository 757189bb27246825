"""How a real ``aiayn-train`` process stops: Ctrl-C saves like SIGTERM and says how to continue; a data
error under DDP ends in one line, not a hang; a full disk is an I/O error with its own status; the console
carries no library noise. (After SIGKILL the CSV holds every row the last checkpoint has seen: test_chaos.)"""

from __future__ import annotations

import errno
import re
import signal
from pathlib import Path

import pytest
import torch

from aiayn.cli.common import IO_ERROR_STATUS
from helpers.batch_recorder import recorder
from helpers.processes import finish, hold_and_signal, saved_step, start, stopped
from helpers.runs import smoke_run, train_in_process

# What a default run may print on stderr: Lightning's own lines about the run (the seed, the devices, why
# training stopped, which checkpoint is tested) and W&B's three about where an offline run is kept (quiet:
# the run's own log says how to sync it). Anything else (a library's warning, W&B's history and summary, a
# traceback) is noise.
ALLOWED = re.compile(
    r"Seed set to \d+"
    r"|[GTHI]PU available: .*"
    r"|Using bfloat16 Automatic Mixed Precision \(AMP\)"  # hardware=cpu where the CPU multiplies bf16
    r"|`Trainer\.fit` stopped: `max_steps=\d+` reached\."
    r"|(Restoring states from|Loaded model weights from) the checkpoint( path)? at \S+\.ckpt(\.\.\.)?"
    r"|wandb: W&B syncing is set to `offline` in this directory\. .*"
    r"|wandb: Run data is saved locally in \S+"
    r"|wandb: View this run in the terminal with `wandb leet`"
)


@pytest.mark.slow
@pytest.mark.parametrize("named", [True, False], ids=["hydra.run.dir", "fresh folder"])
def test_ctrl_c_saves_stops_with_130_and_says_how_to_continue(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, named: bool
) -> None:
    overrides = [*smoke_run(corpus_root, cache_dir), recorder(tmp_path / "batches", hold_at=3)]
    where = [f"hydra.run.dir={tmp_path / 'run'}"] if named else []
    process = start(*overrides, *where, cwd=tmp_path, own_session=True)
    hold_and_signal(process, tmp_path / "batches", signal.SIGINT, group=True)  # what Ctrl-C at the terminal does
    message = stopped(process, signal.SIGINT).strip().splitlines()[-1]
    assert message.startswith("aiayn-train: stopped: SIGINT received: stopped after step "), message
    run_dir = tmp_path / "run" if named else next((tmp_path / "outputs").glob("*/*"))
    assert 3 <= saved_step(run_dir) < 12
    advice = "continue it with the same command" + ("" if named else f" plus hydra.run.dir={run_dir}")
    assert message.endswith(advice)  # (Ctrl-C saves as SIGTERM does: continuing is test_interruptions')


@pytest.mark.slow
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
    process = start("hardware=cpu_ddp", *smoke_run(corpus, tmp_path / "cache"), cwd=tmp_path)
    _, err = process.communicate(timeout=240)  # a rank waiting for the other in a barrier would hang here
    assert process.returncode == 2, err[-3000:]
    (line,) = err.strip().splitlines()
    assert line.startswith("aiayn-train: error: ") and "train.de" in line


def test_a_full_disk_is_reported_in_one_line_with_its_own_status(
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The first checkpoint write meets ENOSPC (simulated: mounting a small tmpfs needs privileges)."""

    def no_space(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    run_dir = tmp_path / "run"
    assert train_in_process([*smoke_run(corpus_root, cache_dir), f"hydra.run.dir={run_dir}"], monkeypatch) == (
        IO_ERROR_STATUS
    )
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("aiayn-train: I/O error: [Errno 28] No space left on device (an input/output error")
    assert not list((run_dir / "checkpoints").glob("*.ckpt"))  # no partial checkpoint in place


@pytest.mark.slow
@pytest.mark.usefixtures("wandb_offline")
def test_a_default_run_prints_no_library_noise(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("WANDB_SILENT", "WANDB_CONSOLE"):  # W&B prints as it does for a user
        monkeypatch.delenv(name)
    err = finish(*smoke_run(corpus_root, cache_dir), "logger=wandb", "progress=quiet", cwd=tmp_path)
    assert "wandb: Run data is saved locally in" in err  # W&B spoke
    noise = [line for line in err.splitlines() if not ALLOWED.fullmatch(line)]
    assert not noise, noise
