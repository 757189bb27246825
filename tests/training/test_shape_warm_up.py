"""With few batch shapes (``data.batch_shapes``) a run meets each of them once before its first step, largest
first, and is otherwise left as it was: the same steps, losses and weights as a run that does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from aiayn.config.compose import compose_run_config
from aiayn.experiments.run import train
from aiayn.training.callbacks.shapes import ShapeWarmUp
from helpers.processes import assert_same_weights, metric_rows, weights
from helpers.runs import resumable_run

STEPS = 5


class Shapes(pl.Callback):
    """The (rows, source, target) shape of every batch the model is trained on, before the first step
    and in the steps."""

    def __init__(self) -> None:
        self.before: list[tuple[int, int, int]] = []
        self.steps: list[tuple[int, int, int]] = []
        self.table: set[tuple[int, int, int]] = set()

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        pl_module.model.register_forward_pre_hook(self.record)

    def record(self, model: torch.nn.Module, args: tuple[Any, ...]) -> None:
        src, tgt_in = args[0], args[1]
        if model.training:
            (self.steps if self.table else self.before).append((src.size(0), src.size(1), tgt_in.size(1)))

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        shapes = trainer.train_dataloader.batch_sampler.shapes
        table = zip(shapes.rows.tolist(), shapes.widths.tolist(), strict=True)
        self.table = {(rows, src, tgt) for rows, (src, tgt) in table}


def run(tmp_path: Path, corpus_root: Path, cache_dir: Path, name: str) -> tuple[Path, Shapes]:
    overrides = resumable_run(
        corpus_root, cache_dir, f"trainer.max_steps={STEPS}", "data.batch_shapes=4", f"checkpoint.every_steps={STEPS}"
    )
    shapes = Shapes()
    train(compose_run_config(overrides), tmp_path / name, overrides, callbacks=[shapes])
    return tmp_path / name, shapes


@pytest.mark.slow
def test_each_batch_shape_is_met_once_before_training_and_the_run_is_unchanged(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warmed, shapes = run(tmp_path, corpus_root, cache_dir, "warmed")
    assert len(shapes.table) == 4
    assert sorted(shapes.before) == sorted(shapes.table)  # each shape once, nothing else
    areas = [rows * (src + tgt) for rows, src, tgt in shapes.before]
    assert areas == sorted(areas, reverse=True)  # largest first: the allocator's first blocks fit the rest
    # every step's shape was met before it, but the epoch's one short batch
    assert sum(shape not in shapes.table for shape in shapes.steps) <= 1 and len(shapes.steps) == STEPS

    monkeypatch.setattr(ShapeWarmUp, "on_train_start", lambda *_: None)
    cold, cold_shapes = run(tmp_path, corpus_root, cache_dir, "cold")
    assert cold_shapes.before == [] and cold_shapes.steps == shapes.steps
    assert_same_weights(weights(cold), weights(warmed))  # no step, no gradient and no random draw kept
    losses = [[row["train/loss"] for row in metric_rows(folder) if "train/loss" in row] for folder in (cold, warmed)]
    assert losses[0] == losses[1] and len(losses[0]) == STEPS
