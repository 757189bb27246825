"""What the framework costs: `aiayn-train`'s whole loop against a bare PyTorch loop on the same batches.

The full loop is `aiayn.train.train` (what `aiayn-train` runs) on the composed config: Lightning's
Trainer with every callback of a run, the W&B logger (offline) and the CSV log, the data loader; a
callback times steps `--warmup` … `--warmup + --steps` of the first epoch, from the start of one to the
start of the step after the last, so data loading and logging between steps count. The bare loop runs
the same module's loss, optimizer and schedule over the same batches, already in memory. The two
alternate, `--rounds` times each. The data pipeline's share is the time the run's own DataLoader takes to
yield those batches, over the full loop's time for them.
Usage: python benchmarks/overhead.py [--data ../shared/data/multi30k] [--model small] [--steps 60]
       [--warmup 3] [--rounds 2] [more aiayn-train overrides]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import pytorch_lightning as pl
from hydra.utils import instantiate

from aiayn.config import module_kwargs
from aiayn.module import TranslationModule
from aiayn.train import train
from train_throughput import our_step
from workload import machine, prepare_process, real_tokens, timed_steps, training_batches, training_config


class StepWindow(pl.Callback):
    """Wall time and real tokens of training steps ``first`` … ``first + count - 1``."""

    def __init__(self, first: int, count: int) -> None:
        self.first, self.count = first, count
        self.start = self.seconds = 0.0
        self.tokens = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.first:
            self.start = time.perf_counter()
        elif batch_idx == self.first + self.count:
            self.seconds = time.perf_counter() - self.start
        if self.first <= batch_idx < self.first + self.count:
            self.tokens += real_tokens(batch)


def full_loop(overrides: list[str], args: argparse.Namespace, tokens: int) -> float:
    """Tokens/s of the window in a real run of `aiayn-train`'s training function, whose window must
    hold ``tokens`` real tokens (the bare loop's batches)."""
    window = StepWindow(args.warmup, args.steps)
    cfg = training_config(args.model, args.data, [*overrides, f"trainer.max_steps={args.warmup + args.steps + 1}"])
    with tempfile.TemporaryDirectory() as run_dir:
        train(cfg, Path(run_dir), callbacks=[window])
    if not window.seconds:
        raise SystemExit("the run ended before the timed window did: an epoch shorter than --warmup + --steps?")
    if window.tokens != tokens:
        raise SystemExit(f"the run trained on other batches ({window.tokens} tokens) than the bare loop ({tokens})")
    return window.tokens / window.seconds


def bare_loop(cfg: Any, batches: list[dict[str, Any]]) -> Callable[[], float]:
    """The same module, loss, optimizer and schedule in a plain loop: a contestant returning tokens/s."""
    pl.seed_everything(cfg.seed, verbose=False)
    return timed_steps(our_step(TranslationModule(**module_kwargs(cfg)).train()), batches)


def loader_seconds(cfg: Any, args: argparse.Namespace) -> float:
    """Seconds the run's training DataLoader takes to yield the window's batches (after the warm-up ones)."""
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/multi30k", help="Multi30k folder (data.root)")
    parser.add_argument("--model", default="small", help="a model config (conf/model); small is the default run's")
    parser.add_argument("--steps", type=int, default=60, help="timed steps (log_every_n_steps is 50)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="more aiayn-train overrides (both loops)")
    args = parser.parse_args()
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")

    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    prepare_process()
    # The run's own logging (W&B offline + CSV), quiet progress, a small evaluation after training.
    overrides = ["logger=wandb", "progress=quiet", "data.eval_limit=16", *args.overrides]
    cfg = training_config(args.model, args.data, overrides)
    batches = training_batches(cfg, args.steps, skip=args.warmup)
    tokens = sum(real_tokens(batch) for batch in batches)
    bare = bare_loop(cfg, batches)
    bare()  # warm-up
    speeds: dict[str, list[float]] = {"bare": [], "aiayn-train": []}
    for _ in range(args.rounds):
        speeds["bare"].append(bare())
        speeds["aiayn-train"].append(full_loop(overrides, args, tokens))
    full, plain = median(speeds["aiayn-train"]), median(speeds["bare"])
    data_share = loader_seconds(cfg, args) / (tokens / full)
    result = {
        "full_vs_bare": round(full / plain, 3),
        "overhead": round(1 - full / plain, 3),
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
