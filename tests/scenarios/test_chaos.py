"""A run killed with SIGKILL at a random moment of every phase (four kills: training, a validation, a
checkpoint write, the final test) and started again each time ends as the uninterrupted run: the same
weights, the same metric rows, the same test BLEU. The kill in training lands past the first checkpoint:
the next process starts from the last checkpoint's step, and the CSV on disk holds every row that
checkpoint has seen. The seed is printed; ``AIAYN_CHAOS_SEED`` repeats the order of the kills and the
marks each waits for (the moment within a phase depends on the machine's speed too)."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from helpers.processes import assert_same_weights, finish, killed, metric_rows, saved_step, start, weights

pytestmark = pytest.mark.slow
PHASES = ("train", "validation", "save", "test")
TIMED = ("tokens_per_s", "mfu", "seconds")  # columns that measure the machine, not the run
EVERY = 3  # the reference run's checkpoint.every_steps


def marker(run_dir: Path) -> str:
    return f"callbacks=[{{_target_:helpers.phases.PhaseMarker,folder:'{run_dir.parent / run_dir.name}-phases'}}]"


def phases(run_dir: Path) -> list[dict]:
    path = run_dir.parent / f"{run_dir.name}-phases" / "phases.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def kill_in(command: list[str], run_dir: Path, phase: str, rng: random.Random) -> int | None:
    """Start the run and SIGKILL it at a random moment once it is in ``phase`` (in training, past the first
    checkpoint); its pid, or None when the run ended first (it had no more of that phase)."""
    seen = sum(1 for mark in phases(run_dir) if mark["phase"] == phase)
    # The first or a later mark of training, where a run has a mark per step; the next one of the phases
    # a run passes a few times (a validation and a save per checkpoint, one test): a later one may never
    # come, once earlier kills have left the run fewer of them
    wanted = seen + 1 + (rng.randrange(3) if phase == "train" else 0)
    process = start(*command, marker(run_dir))

    def arrived() -> bool:
        marks = [mark for mark in phases(run_dir) if mark["phase"] == phase]
        return len(marks) >= wanted and (phase != "train" or marks[-1]["step"] > EVERY)

    deadline = time.monotonic() + 300
    while not arrived():
        if process.poll() is not None:
            _, err = process.communicate()
            assert process.returncode == 0, err[-3000:]
            return None
        assert time.monotonic() < deadline, f"no {phase} phase"
        time.sleep(0.005)
    time.sleep(rng.uniform(0, 0.05))
    killed(process)
    return process.pid


def rows_before(run_dir: Path, step: int) -> list[dict[str, str]]:
    return [row for row in metric_rows(run_dir, TIMED) if int(row["step"]) < step]


def test_a_run_killed_in_every_phase_ends_as_the_uninterrupted_run(
    tmp_path: Path, reference_run: Path, reference_overrides: list[str]
) -> None:
    seed = int(os.environ.get("AIAYN_CHAOS_SEED", random.randrange(1_000_000)))
    print(f"chaos seed: {seed} (AIAYN_CHAOS_SEED={seed} repeats these kills)")
    rng = random.Random(seed)
    run_dir = tmp_path / "killed"
    command = [f"hydra.run.dir={run_dir}", *reference_overrides]
    kills = list(PHASES)  # each phase once, in a random order (the test last)
    rng.shuffle(kills)
    kills.sort(key=lambda phase: phase == "test")  # the test comes last in a run: its kills come last
    done, continued_at = [], None
    for phase in kills:
        pid = kill_in(command, run_dir, phase, rng)
        if pid is None:
            continue
        done.append(phase)
        if phase == "train":
            last_mark = max(mark["step"] for mark in phases(run_dir) if mark["pid"] == pid and mark["phase"] == "train")
            saved = saved_step(run_dir)
            assert saved % EVERY == 0 and EVERY <= saved <= last_mark, f"seed {seed}: saved {saved}, at {last_mark}"
            # a training row of optimizer step N has Lightning's step N - 1, as has a validation after step N
            assert rows_before(run_dir, saved) == rows_before(reference_run, saved), f"seed {seed}: rows lost"
            continued_at = (pid, saved)
    assert set(PHASES) <= set(done), f"seed {seed}: killed only in {done}"
    finish(*command, marker(run_dir))

    assert continued_at is not None
    pid, saved = continued_at
    trained = [mark for mark in phases(run_dir) if mark["phase"] == "train"]
    first = [mark["pid"] for mark in trained].index(pid)
    next_process = next(mark for mark in trained[first:] if mark["pid"] != pid)  # the one that continued it
    assert next_process["step"] == saved, f"seed {seed}: continued at {next_process['step']}, not {saved}"
    assert_same_weights(weights(reference_run), weights(run_dir))
    assert metric_rows(run_dir, TIMED) == metric_rows(reference_run, TIMED), f"seed {seed}: other metric rows"
    results = [json.loads((folder / "results.json").read_text()) for folder in (reference_run, run_dir)]
    assert results[0]["test_bleu"] == results[1]["test_bleu"], f"seed {seed}"
    assert results[0]["val_bleu"] == results[1]["val_bleu"] and results[0]["steps"] == results[1]["steps"] == 12
