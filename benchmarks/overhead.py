"""What the framework costs: `aiayn-train`'s whole loop against a bare PyTorch loop on the same batches.

The full loop is `aiayn.experiments.run.train` (what `aiayn-train` runs) on the composed config: Lightning's
Trainer with every callback of a run, the W&B logger (offline) and the CSV log, the data loader. The
bare loop is the same module's loss, optimizer and schedule in plain PyTorch, on a second copy of the
model. The two are interleaved step by step, so that this shared machine's slow minutes hit both alike:
for steps `--warmup` … `--warmup + --steps - 1` of the run, a callback first runs the bare step on the
batch Lightning is about to train on (timed apart), then lets the run's step go; the run's time for a
step runs from there to the start of its next step, so its data loading, logging and callbacks count.
`--rounds` runs, medians. The data pipeline's share is the time the run's own DataLoader takes to yield
those batches, over the full loop's time for them.
Usage: python benchmarks/overhead.py [--data ../shared/data/multi30k] [--model small] [--steps 60]
       [--warmup 3] [--rounds 2] [more aiayn-train overrides]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import pytorch_lightning as pl
from hydra.utils import instantiate
from omegaconf import DictConfig

from aiayn.config.plan import module_settings
from aiayn.experiments.run import train
from train_throughput import Step, our_step
from workload import benchmark_parser, machine, parse_counts, prepare_process, real_tokens, training_config


class Interleaved(pl.Callback):
    """Before each of the run's steps ``first`` … ``first + count - 1``, a bare step on the same batch;
    sums both loops' seconds and the window's real tokens. Earlier steps warm the bare loop up."""

    def __init__(self, bare_step: Step, first: int, count: int) -> None:
        self.bare_step, self.first, self.count = bare_step, first, count
        self.bare_seconds = self.full_seconds = 0.0
        self.tokens = self.timed = 0  # real tokens and steps of the full loop timed
        self._resumed: float | None = None  # when the run's current step began

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._resumed is not None:  # the run's previous step, and the loading of this batch
            self.full_seconds += now - self._resumed
            self.timed += 1
            self._resumed = None
        if trainer.current_epoch > 0 or batch_idx >= self.first + self.count:
            return
        self.bare_step(batch)
        if batch_idx >= self.first:
            self.bare_seconds += time.perf_counter() - now
            self.tokens += real_tokens(batch)
            self._resumed = time.perf_counter()


def interleaved_run(cfg: DictConfig, args: argparse.Namespace) -> Interleaved:
    """One run of `aiayn-train`'s training function with the bare loop interleaved."""
    pl.seed_everything(cfg.seed, verbose=False)
    bare = our_step(module_settings(cfg).build().train())
    timer = Interleaved(bare, args.warmup, args.steps)
    with tempfile.TemporaryDirectory() as run_dir:
        train(cfg, Path(run_dir), callbacks=[timer])
    if timer.timed != args.steps:
        raise SystemExit(
            f"{timer.timed} of {args.steps} steps were timed: the run stopped early (trainer.max_time?) or its "
            "first epoch is shorter than --warmup + --steps + 1 batches"
        )
    return timer


def loader_seconds(cfg: DictConfig, args: argparse.Namespace) -> float:
    """Seconds the run's training DataLoader takes to yield the timed steps' batches."""
    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    loader = iter(datamodule.train_dataloader())
    for _ in range(args.warmup):
        next(loader)
    start = time.perf_counter()
    for _ in range(args.steps):
        next(loader)
    return time.perf_counter() - start


def main() -> None:
    parser = benchmark_parser(__doc__, steps=60, rounds=2, steps_help="timed steps (log_every_n_steps is 50)")
    parser.add_argument("--model", default="small", help="a model config (conf/model); small is the default run's")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (they allocate Adam's state)")
    args = parse_counts(parser, "warmup")

    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    prepare_process()
    # The run's own logging (W&B offline + CSV), quiet progress, a small evaluation after training.
    overrides = ["logger=wandb", "progress=quiet", "data.eval_limit=16", "cpu_bf16=false", *args.overrides]
    cfg = training_config(args.model, args.data, [*overrides, f"trainer.max_steps={args.warmup + args.steps + 1}"])
    trainer = cfg.trainer
    accumulating = trainer.accumulate_grad_batches != 1 or cfg.tokens_per_step is not None
    if (trainer.accelerator, trainer.precision) != ("cpu", "32-true") or accumulating:
        # the bare step runs in fp32 on the CPU and steps its optimizer on every batch
        raise SystemExit("overhead.py compares fp32 CPU runs without gradient accumulation (hardware=cpu)")
    runs = [interleaved_run(cfg, args) for _ in range(args.rounds)]
    speeds = {
        "bare": [run.tokens / run.bare_seconds for run in runs],
        "aiayn-train": [run.tokens / run.full_seconds for run in runs],
    }
    ratio = median(run.bare_seconds / run.full_seconds for run in runs)
    data_share = loader_seconds(cfg, args) / median(run.full_seconds for run in runs)
    result = {
        "full_vs_bare": round(ratio, 3),
        "overhead": round(1 - ratio, 3),
        "data_share": round(data_share, 4),
        "tokens_per_s": {name: round(median(values)) for name, values in speeds.items()},
    }

    print(machine())
    print(f"model={args.model}: steps {args.warmup}..{args.warmup + args.steps - 1}, {args.rounds} rounds")
    print(f"{'loop':<14}{'tokens/s (median)':>19}{'all rounds':>24}")
    for name, values in speeds.items():
        print(f"{name:<14}{median(values):>19.0f}{' '.join(f'{v:.0f}' for v in values):>24}")
    print(f"aiayn-train / bare = {result['full_vs_bare']:.3f}; data loading {100 * data_share:.2f}% of step time")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
