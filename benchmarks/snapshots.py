"""The training thread's time per step checkpoint for averaging: the whole training state written where
the step is (what every `checkpoint.average_every` step paid before: Lightning's save of weights, Adam's
moments, the EMA and the loops, written atomically) against a weights-only snapshot (copied, then written
by a background thread).

One run of `aiayn-train`'s training function (`model=base` by default, Multi30k, `checkpoint.average_every=1`):
after each of the steps `--warmup + 1` ... `--warmup + --steps`, once the background writer has finished the
previous snapshot (untimed), a callback times `trainer.save_checkpoint` of the whole state into a scratch
file, and then the run's own snapshot (`StepCheckpoints._save`, and the next optimizer step's wait for its
copy) is timed. Medians over the steps; the first snapshot (which gathers the entries besides the weights
once per fit) apart.
Usage: python benchmarks/snapshots.py [--data ../shared/data/multi30k] [--model base] [--steps 4]
       [--warmup 1] [more aiayn-train overrides]
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import pytorch_lightning as pl

from aiayn.experiments.run import train
from aiayn.training.callbacks.checkpointing import StepCheckpoints
from workload import benchmark_parser, machine, parse_counts, prepare_process, training_config


class SaveTimes(pl.Callback):
    """Times both saves after the steps ``first + 1`` ... ``first + count``, and the snapshot of step 1 (it
    runs before the run's checkpoint callbacks, which Lightning moves to the end). A snapshot's time is its
    call's and the wait for its copy at the next optimizer step's."""

    def __init__(self, scratch: Path, first: int, count: int) -> None:
        self.scratch, self.first, self.count = scratch, first, count
        self.whole_s: list[float] = []
        self.snapshot_s: list[float] = []
        self.first_snapshot_s: list[float] = []
        self.sizes: dict[str, int] = {}
        self._pending: tuple[list[float], float, float] | None = None  # where to, its call's seconds, held_s

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        steps = step_checkpoints(trainer)
        if self._pending is not None and steps._writer is not None:  # this step held for the previous copy
            into, seconds, held = self._pending
            into.append(seconds + steps._writer.held_s - held)
            self._pending = None
        if trainer.global_step == 1:
            self._time_snapshot(steps, self.first_snapshot_s)
        if not self.first < trainer.global_step <= self.first + self.count:
            return
        steps._flush()  # the previous snapshot's write is the background's, not this step's
        start = time.perf_counter()
        trainer.save_checkpoint(self.scratch, weights_only=False)
        self.whole_s.append(time.perf_counter() - start)
        self.sizes["whole"] = self.scratch.stat().st_size
        self._time_snapshot(steps, self.snapshot_s)

    def _time_snapshot(self, steps: StepCheckpoints, into: list[float]) -> None:
        """Time the run's own snapshot of this step, which runs after this callback."""
        save = steps._save

        def timed(trainer: pl.Trainer) -> None:
            start = time.perf_counter()
            save(trainer)
            seconds = time.perf_counter() - start
            held = steps._writer.held_s if steps._writer is not None else 0.0
            self._pending = into, seconds, held
            del steps._save  # back to the class's method

        steps._save = timed

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        steps = step_checkpoints(trainer)
        steps._flush()
        newest = max(Path(path) for path in steps.best_k_models)
        self.sizes["snapshot"] = newest.stat().st_size


def step_checkpoints(trainer: pl.Trainer) -> StepCheckpoints:
    return next(callback for callback in trainer.callbacks if isinstance(callback, StepCheckpoints))


def main() -> None:
    parser = benchmark_parser(__doc__, steps=4, rounds=1, steps_help="timed steps, each with both saves")
    parser.add_argument("--model", default="base", help="a model config (conf/model)")
    parser.add_argument("--warmup", type=int, default=1, help="steps first (Adam's state is made at the first)")
    args = parse_counts(parser, "warmup")

    prepare_process()
    last = args.warmup + args.steps + 1  # the last timed snapshot's copy is waited for at the step after it
    overrides = [
        "progress=quiet",
        "checkpoint.average_every=1",
        f"checkpoint.keep_last={args.steps + 1}",
        "checkpoint.average_last=0",
        f"checkpoint.every_steps={last}",
        f"trainer.max_steps={last}",
        "data.max_tokens=256",  # short steps: the saves are what is timed
        "data.eval_limit=2",
        "decoding=greedy",
        "cpu_bf16=false",
        *args.overrides,
    ]
    cfg = training_config(args.model, args.data, overrides)
    with tempfile.TemporaryDirectory() as folder:
        timer = SaveTimes(Path(folder) / "whole.ckpt", args.warmup, args.steps)
        train(cfg, Path(folder) / "run", callbacks=[timer])
    if len(timer.snapshot_s) != args.steps:
        raise SystemExit(f"{len(timer.snapshot_s)} of {args.steps} snapshots were timed")
    whole_ms, snapshot_ms = 1000 * median(timer.whole_s), 1000 * median(timer.snapshot_s)
    result = {
        "model": args.model,
        "whole_state_ms": round(whole_ms, 1),
        "snapshot_ms": round(snapshot_ms, 1),
        "first_snapshot_ms": round(1000 * timer.first_snapshot_s[0], 1),
        "snapshot_vs_whole": round(snapshot_ms / whole_ms, 4),
        "whole_state_mb": round(timer.sizes["whole"] / 1e6, 1),
        "snapshot_mb": round(timer.sizes["snapshot"] / 1e6, 1),
    }

    print(machine())
    print(f"model={args.model}: steps {args.warmup + 1}..{last - 1}, {os.cpu_count()} cores")
    print(f"{'save':<34}{'ms (median)':>12}{'all steps':>30}{'MB':>8}")
    rows = (
        ("whole state, on the step", timer.whole_s, "whole"),
        ("weights-only snapshot", timer.snapshot_s, "snapshot"),
    )
    for name, seconds, size in rows:
        shown = " ".join(f"{1000 * s:.0f}" for s in seconds)
        print(f"{name:<34}{1000 * median(seconds):>12.1f}{shown:>30}{timer.sizes[size] / 1e6:>8.0f}")
    print(f"first snapshot (gathers the config, tokenizer, hyperparameters): {result['first_snapshot_ms']:.1f} ms")
    print(f"snapshot / whole state = {result['snapshot_vs_whole']:.4f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
