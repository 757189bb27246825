"""Real training processes stopped from outside: a preemption signal saves a checkpoint that the restarted
run continues from; after SIGKILL the run continues from its last checkpoint; either way it ends with the
weights of an uninterrupted run. Checkpoints are written atomically, a truncated one is refused with the
way out, and ``resume=true`` finds the latest run of an experiment."""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
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
from helpers.batch_recorder import recorded
from helpers.runs import resumable_run, train_in_process

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parent
STEPS = 16


def command(run_dir: Path, overrides: list[str], pause: float = 0.0) -> list[str]:
    recorder = f"callbacks=[{{_target_:helpers.batch_recorder.BatchRecorder,folder:'{run_dir}',pause:{pause}}}]"
    return [sys.executable, "-m", "aiayn.cli.train", f"hydra.run.dir={run_dir}", recorder, *overrides]


def start(run_dir: Path, overrides: list[str], pause: float = 0.0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{run_dir.name}.stderr", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(command(run_dir, overrides, pause), env=env, stdout=subprocess.DEVNULL, stderr=log)


def finish(run_dir: Path, overrides: list[str]) -> dict:
    process = start(run_dir, overrides)
    assert process.wait(timeout=600) == 0, stderr(run_dir)[-3000:]
    return json.loads((run_dir / "results.json").read_text())


def stderr(run_dir: Path) -> str:
    return (run_dir.parent / f"{run_dir.name}.stderr").read_text()


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as rows:
        return list(csv.DictReader(rows))


def wait_for_batches(run_dir: Path, process: subprocess.Popen, count: int) -> None:
    """Until the run has started its ``count``-th training batch."""
    deadline = time.monotonic() + 600
    path = run_dir / "batches.rank0.jsonl"
    while not (path.is_file() and len(path.read_text().splitlines()) >= count):
        assert process.poll() is None, f"the run ended early: {stderr(run_dir)[-3000:]}"
        assert time.monotonic() < deadline, "the run did not reach the batch"
        time.sleep(0.05)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


def assert_same_weights(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_saves_a_checkpoint_that_the_restarted_run_continues_from(
    signum: signal.Signals, tmp_path: Path, multi30k_root: Path, cache_dir: Path
) -> None:
    # validations every 3 steps: the signal usually lands at step 6, which validates before the run stops
    overrides = resumable_run(multi30k_root, cache_dir, f"trainer.max_steps={STEPS}", "checkpoint.every_steps=3")
    whole = finish(tmp_path / "whole", overrides)

    run_dir = tmp_path / "run"
    process = start(run_dir, overrides, pause=0.3)
    wait_for_batches(run_dir, process, 6)
    process.send_signal(signum)
    assert process.wait(timeout=300) == 128 + signum  # as a shell reports a process a signal ended
    # the step under way when the signal came was finished and saved; the next batch had been fetched
    done = len(recorded(run_dir)) - 1
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert 6 <= done < STEPS and saved["global_step"] == done
    message = stderr(run_dir).strip().splitlines()[-1]
    assert message == (
        f"aiayn-train: stopped: {signum.name} received: stopped after step {done} and saved "
        f"{run_dir / 'checkpoints' / 'last.ckpt'}; continue it with the same command"
    )
    assert not (run_dir / "results.json").exists()

    again = finish(run_dir, overrides)  # the same command: a requeued job
    assert again["resumed_from"] == str(run_dir / "checkpoints" / "last.ckpt") and again["steps"] == STEPS
    records = recorded(run_dir)
    del records[done]  # the batch fetched before the stop, which the restarted run began with
    assert [record["step"] for record in records] == list(range(STEPS))  # each step once
    assert [record["index"] for record in records] == [record["index"] for record in recorded(tmp_path / "whole")]
    assert again["train_tokens"] == whole["train_tokens"]
    assert_same_weights(weights(tmp_path / "whole"), weights(run_dir))
    for key in ("train/loss", "val/bleu"):  # both parts' metrics, none deleted; every validation, once
        logged = [[row["step"] for row in metric_rows(d) if row.get(key)] for d in (run_dir, tmp_path / "whole")]
        assert logged[0] == logged[1] and logged[0], key
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step*.ckpt")) == sorted(
        p.name for p in (tmp_path / "whole" / "checkpoints").glob("step*.ckpt")
    )


def test_a_run_killed_at_a_random_step_resumes_to_the_uninterrupted_weights(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path
) -> None:
    overrides = resumable_run(multi30k_root, cache_dir, f"trainer.max_steps={STEPS}", "checkpoint.every_steps=3")
    finish(tmp_path / "whole", overrides)

    seed = random.randrange(1 << 30)
    kill_at = random.Random(seed).randint(4, STEPS - 2)  # a step past the first checkpoint (step 3)
    run_dir = tmp_path / "run"
    process = start(run_dir, overrides, pause=0.2)
    wait_for_batches(run_dir, process, kill_at + 1)
    process.kill()  # SIGKILL: no handler runs, nothing is saved
    assert process.wait(timeout=60) == -signal.SIGKILL
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert saved % 3 == 0 and 3 <= saved <= kill_at, f"seed {seed}"

    again = finish(run_dir, overrides)
    assert again["steps"] == STEPS and again["resumed_from"].endswith("last.ckpt"), f"seed {seed}"
    steps = [record["step"] for record in recorded(run_dir)]
    resumed = len(steps) - (STEPS - saved)  # the second process's records follow the first one's
    assert steps[resumed:] == list(range(saved, STEPS)), f"seed {seed}"
    assert_same_weights(weights(tmp_path / "whole"), weights(run_dir))


def test_a_process_killed_while_saving_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    save_checkpoint({"step": -1, "weights": torch.zeros(4)}, path)
    writer = (
        "import sys, torch\n"
        "from aiayn.training.checkpoints import save_checkpoint\n"
        "big = torch.randn(8_000_000)\n"
        "print('ready', flush=True)\n"
        "for step in range(10**6):\n"
        f"    save_checkpoint({{'step': step, 'weights': big}}, {str(path)!r})\n"
    )
    for attempt in range(3):  # kill at different points of a 32 MB write
        process = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
        assert process.stdout.readline() == "ready\n"
        time.sleep(0.3 + 0.37 * attempt)
        process.kill()
        process.wait(timeout=60)
        process.stdout.close()
        checkpoint = torch.load(path, weights_only=True)  # whole: the old file or a complete new one
        assert checkpoint["step"] >= -1 and checkpoint["weights"].numel() in (4, 8_000_000)
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
    tmp_path: Path, multi30k_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    overrides = [*resumable_run(multi30k_root, cache_dir, "checkpoint.every_steps=3"), f"hydra.run.dir={run_dir}"]
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
    tmp_path: Path, multi30k_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}, "optimizer_states": [], "loops": {}, "args": argparse.Namespace(lr=0.1)}, foreign)
    base = resumable_run(multi30k_root, cache_dir, "trainer.max_steps=2")
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
    tmp_path: Path, multi30k_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    base = resumable_run(multi30k_root, cache_dir)
    assert train_in_process([*base, "trainer.max_steps=3"], monkeypatch) == 0
    (first,) = (tmp_path / "outputs" / "tiny_multi30k_en_de").iterdir()
    crashed = tmp_path / "outputs" / "tiny_multi30k_en_de" / "2999-01-01_00-00-00"  # newer, never checkpointed
    (crashed / ".hydra").mkdir(parents=True)

    assert train_in_process([*base, "trainer.max_steps=6", "resume=true"], monkeypatch) == 0
    results = json.loads((first / "results.json").read_text())
    assert results["steps"] == 6 and results["resumed_from"] == str(first / "checkpoints" / "last.ckpt")
    assert sorted(p.name for p in first.parent.iterdir()) == sorted([first.name, crashed.name])  # no new folder


def test_a_signal_to_the_first_ddp_rank_stops_both_ranks_at_one_step(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path
) -> None:
    overrides = ["hardware=cpu_ddp", *resumable_run(multi30k_root, cache_dir, f"trainer.max_steps={STEPS}")]
    run_dir = tmp_path / "run"
    process = start(run_dir, overrides, pause=0.3)
    wait_for_batches(run_dir, process, 5)
    process.send_signal(signal.SIGTERM)  # to the launching process (rank 0) only, as `kill <pid>` would
    assert process.wait(timeout=300) == 128 + signal.SIGTERM, stderr(run_dir)[-3000:]
    done = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    # both ranks finished the same steps and had fetched one batch more
    assert [len(recorded(run_dir, rank)) for rank in (0, 1)] == [done + 1, done + 1]

    again = finish(run_dir, overrides)
    assert again["steps"] == STEPS and again["resumed_from"].endswith("last.ckpt")
    for rank in (0, 1):
        records = recorded(run_dir, rank)
        del records[done]
        assert [record["step"] for record in records] == list(range(STEPS))


def test_sigterm_while_testing_exits_with_143(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """After training, Lightning's own handler stops evaluation at SIGTERM; that is a stop, not a success."""
    with pytest.raises(SystemExit) as stopped, reported_run_errors("aiayn-train", tmp_path, created=False):
        raise SIGTERMException
    assert stopped.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.startswith("aiayn-train: stopped: SIGTERM received after training")
    assert tmp_path.is_dir()
