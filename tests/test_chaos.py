"""A run killed with SIGKILL at random moments of every phase (six kills) (training, a validation, a checkpoint write,
the final test) and started again each time ends as the uninterrupted run: the same weights, the same
metric rows, the same test BLEU. The seed of the kills is printed; ``AIAYN_CHAOS_SEED`` repeats them."""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers.runs import resumable_run

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
PHASES = ("train", "validation", "save", "test")
TIMED = ("tokens_per_s", "mfu")  # columns that measure the machine, not the run


def command(run_dir: Path, overrides: list[str]) -> list[str]:
    marker = f"callbacks=[{{_target_:helpers.phases.PhaseMarker,folder:'{run_dir.parent / run_dir.name}-phases'}}]"
    return [sys.executable, "-m", "aiayn.cli.train", f"hydra.run.dir={run_dir}", marker, *overrides]


def phases(run_dir: Path) -> list[dict]:
    path = run_dir.parent / f"{run_dir.name}-phases" / "phases.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as rows:
        return [
            {key: value for key, value in row.items() if value and not key.endswith(TIMED)}
            for row in csv.DictReader(rows)
        ]


def kill_in(run_dir: Path, overrides: list[str], phase: str, rng: random.Random) -> bool:
    """Start the run and SIGKILL it once it is in ``phase`` (after a random moment of it); False when
    the run ended first (it had no more of that phase)."""
    seen = sum(1 for mark in phases(run_dir) if mark["phase"] == phase)
    process = subprocess.Popen(command(run_dir, overrides), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while sum(1 for mark in phases(run_dir) if mark["phase"] == phase) <= seen + rng.randrange(3):
        if process.poll() is not None:
            assert process.returncode == 0, process.stderr.read().decode()[-3000:]
            return False
        assert time.monotonic() < deadline, f"no {phase} phase"
        time.sleep(0.005)
    time.sleep(rng.uniform(0, 0.05))
    process.kill()
    process.wait(timeout=60)
    process.stderr.close()
    return True


def test_a_run_killed_in_every_phase_ends_as_the_uninterrupted_run(
    tmp_path: Path, corpus_root: Path, cache_dir: Path
) -> None:
    seed = int(os.environ.get("AIAYN_CHAOS_SEED", random.randrange(1_000_000)))
    print(f"chaos seed: {seed} (AIAYN_CHAOS_SEED={seed} repeats these kills)")
    rng = random.Random(seed)
    overrides = resumable_run(corpus_root, cache_dir, "trainer.max_steps=12", "checkpoint.every_steps=3")
    whole = tmp_path / "whole"
    subprocess.run(command(whole, overrides), env=ENV, check=True, capture_output=True, timeout=600)

    run_dir = tmp_path / "killed"
    kills = list(PHASES)  # each phase once, in a random order (the test last)
    rng.shuffle(kills)
    kills.sort(key=lambda phase: phase == "test")  # the test comes last in a run: its kills come last
    done = [phase for phase in kills if kill_in(run_dir, overrides, phase, rng)]
    assert {"train", "validation", "save", "test"} <= set(done), f"seed {seed}: killed only in {done}"
    finished = subprocess.run(command(run_dir, overrides), env=ENV, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, f"seed {seed}: {finished.stderr[-3000:]}"

    expected = torch.load(whole / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    actual = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected), f"seed {seed}: other weights"
    assert metric_rows(run_dir) == metric_rows(whole), f"seed {seed}: other metric rows"
    results = [json.loads((folder / "results.json").read_text()) for folder in (whole, run_dir)]
    assert results[0]["test_bleu"] == results[1]["test_bleu"], f"seed {seed}"
    assert results[0]["val_bleu"] == results[1]["val_bleu"] and results[0]["steps"] == results[1]["steps"] == 12
