"""Real training processes stopped from outside: a preemption signal saves a checkpoint that the restarted
run continues from, and it ends with the weights of the uninterrupted run (a kill at any moment is
test_chaos's, a signal under DDP test_distributed_run's). Checkpoints are written atomically, a truncated
one is refused with the way out, and ``resume=true`` finds the latest run of an experiment."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from pytorch_lightning.utilities.exceptions import SIGTERMException

from aiayn.cli.common import reported_run_errors
from aiayn.training.checkpoints import save_checkpoint
from helpers.batch_recorder import recorded, recorder
from helpers.processes import assert_same_weights, finish, hold_and_signal, logged_steps, start, stopped, weights
from helpers.runs import resumable_run, train_in_process

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_saves_a_checkpoint_that_the_restarted_run_continues_from(
    signum: signal.Signals, tmp_path: Path, reference_run: Path, reference_overrides: list[str]
) -> None:
    steps = json.loads((reference_run / "results.json").read_text())["steps"]
    run_dir = tmp_path / "run"
    command = [f"hydra.run.dir={run_dir}", *reference_overrides]
    process = start(*command, recorder(run_dir, hold_at=6))  # step 6 validates and checkpoints, then the stop
    held = hold_and_signal(process, run_dir, signum)
    err = stopped(process, signum)
    # the step under way when the signal came was finished and saved; the next batch had been fetched
    done = len(recorded(run_dir)) - 1
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert held == 6 <= done < steps and saved["global_step"] == done
    assert err.strip().splitlines()[-1] == (
        f"aiayn-train: stopped: {signum.name} received: stopped after step {done} and saved "
        f"{run_dir / 'checkpoints' / 'last.ckpt'}; continue it with the same command"
    )
    assert not (run_dir / "results.json").exists()
    if signum != signal.SIGUSR1:
        return  # the continued run reads last.ckpt alone, whichever signal wrote it: once is enough

    err = finish(*command, recorder(run_dir))  # the same command: a job that SLURM requeued after SIGUSR1
    assert "exists and is not empty" not in err  # continuing into its own checkpoints is no news
    again = json.loads((run_dir / "results.json").read_text())
    whole = json.loads((reference_run / "results.json").read_text())
    assert again["resumed_from"] == str(run_dir / "checkpoints" / "last.ckpt") and again["steps"] == steps
    records = recorded(run_dir)
    del records[done]  # the batch fetched before the stop, which the restarted run began with
    assert [record["step"] for record in records] == list(range(steps))  # each step once
    assert [record["index"] for record in records] == [record["index"] for record in recorded(reference_run)]
    assert again["train_tokens"] == whole["train_tokens"]
    assert_same_weights(weights(reference_run), weights(run_dir))
    for key in ("train/loss", "val/bleu"):  # both parts' metrics, none deleted; every validation, once
        assert logged_steps(run_dir, key) == logged_steps(reference_run, key) != [], key
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step*.ckpt")) == sorted(
        p.name for p in (reference_run / "checkpoints").glob("step*.ckpt")
    )


def test_a_process_killed_while_saving_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    save_checkpoint({"step": -1, "weights": torch.zeros(4)}, path)
    # One process imports torch; each line it reads forks a writer that saves until it is killed (the
    # parent runs no torch op, so the fork is safe) and, once the writer is reaped, says so.
    writers = (
        "import os, sys, torch\n"
        "from aiayn.training.checkpoints import save_checkpoint\n"
        "for _ in sys.stdin:\n"
        "    if (pid := os.fork()) == 0:\n"
        "        big = torch.randn(8_000_000)\n"
        "        print(os.getpid(), flush=True)\n"
        "        for step in range(10**6):\n"
        f"            save_checkpoint({{'step': step, 'weights': big}}, {str(path)!r})\n"
        "    os.waitpid(pid, 0)\n"
        "    print('reaped', flush=True)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", writers], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    mid_write = 0  # kills that left a writer's temporary file: they landed in the middle of a save
    for attempt in range(3):  # kill at different points of a 32 MB write
        process.stdin.write("write\n")
        process.stdin.flush()
        writer = int(process.stdout.readline())
        time.sleep(0.3 + 0.37 * attempt)
        os.kill(writer, signal.SIGKILL)
        assert process.stdout.readline() == "reaped\n"
        mid_write += any(tmp_path.glob(f".{path.name}.*{writer}*.tmp"))
        checkpoint = torch.load(path, weights_only=True)  # whole: the old file or a complete new one
        assert checkpoint.keys() == {"step", "weights"} and checkpoint["weights"].numel() in (4, 8_000_000)
    assert mid_write > 0
    process.communicate(timeout=60)
    save_checkpoint({"step": 0}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # the killed writers' temporary files are gone


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "last.ckpt"
    save_checkpoint({"step": 1}, path)

    def disk_full(obj: object, f: object) -> None:
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_truncated_checkpoint_is_refused_and_the_previous_one_is_named(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    overrides = [*resumable_run(corpus_root, cache_dir, "checkpoint.every_steps=3"), f"hydra.run.dir={run_dir}"]
    assert train_in_process([*overrides, "trainer.max_steps=6"], monkeypatch) == 0
    last, step6 = run_dir / "checkpoints" / "last.ckpt", run_dir / "checkpoints" / "step0000006.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a disk that lost the end of the file
    capsys.readouterr()

    assert train_in_process([*overrides, "trainer.max_steps=9"], monkeypatch) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"aiayn-train: error: checkpoint {last} cannot be read; it is truncated")
    assert error.endswith(f"the newest readable checkpoint of the run is {step6}: continue from it with resume={step6}")
    assert step6.is_file() and torch.load(step6, weights_only=True)["global_step"] == 6  # still there

    assert train_in_process([*overrides, "trainer.max_steps=9", f"resume={step6}"], monkeypatch) == 0
    results = json.loads((run_dir / "results.json").read_text())
    assert results["steps"] == 9 and results["resumed_from"] == str(step6)


def test_a_foreign_or_mismatched_checkpoint_is_refused(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}, "optimizer_states": [], "loops": {}, "args": argparse.Namespace(lr=0.1)}, foreign)
    base = resumable_run(corpus_root, cache_dir, "trainer.max_steps=2")
    assert train_in_process([*base, f"resume={foreign}"], monkeypatch) == 2
    assert "holds argparse.Namespace objects" in capsys.readouterr().err

    run_dir = tmp_path / "run"
    assert train_in_process([*base, f"hydra.run.dir={run_dir}"], monkeypatch) == 0
    capsys.readouterr()
    assert (
        train_in_process([*base, "model.d_ff=64", f"resume={run_dir / 'checkpoints' / 'last.ckpt'}"], monkeypatch) == 2
    )
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "was trained with model.d_ff=128, this run has model.d_ff=64: a resumed run cannot change it" in error


def test_resume_true_continues_the_latest_run_of_the_experiment(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    base = resumable_run(corpus_root, cache_dir)
    assert train_in_process([*base, "trainer.max_steps=3"], monkeypatch) == 0
    (first,) = (tmp_path / "outputs" / "tiny_multi30k_en_de").iterdir()
    crashed = tmp_path / "outputs" / "tiny_multi30k_en_de" / "2999-01-01_00-00-00"  # newer, never checkpointed
    (crashed / ".hydra").mkdir(parents=True)

    assert train_in_process([*base, "trainer.max_steps=6", "resume=true"], monkeypatch) == 0
    results = json.loads((first / "results.json").read_text())
    assert results["steps"] == 6 and results["resumed_from"] == str(first / "checkpoints" / "last.ckpt")
    assert sorted(p.name for p in first.parent.iterdir()) == sorted([first.name, crashed.name])  # no new folder


def test_sigterm_while_testing_exits_with_143(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """After training, Lightning's own handler stops evaluation at SIGTERM; that is a stop, not a success."""
    with pytest.raises(SystemExit) as stopped, reported_run_errors("aiayn-train", tmp_path, created=False):
        raise SIGTERMException
    assert stopped.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.startswith("aiayn-train: stopped: SIGTERM received after training")
    assert tmp_path.is_dir()
