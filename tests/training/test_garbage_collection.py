"""Python's garbage collection in a real run (``gc_every``): none of Python's own while the fit trains, the
young generations collected after every N-th optimizer step and everything unfrozen after each validation;
the collector as it was once the fit ends, also when it fails."""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl

from aiayn.config.compose import compose_run_config
from aiayn.errors import FieldError
from aiayn.experiments.run import train
from aiayn.training.callbacks.garbage import ScheduledCollection
from helpers.runs import resumable_run

STEPS = 6


class Collections(pl.Callback):
    """Counts the collections of each generation while the fit trains (from the start of training to its
    end), by where they happen: in a step (from the start of its batch to the end of its optimizer step)
    or between steps."""

    def __init__(self) -> None:
        self.counted: Counter[tuple[str, int]] = Counter()
        self.where: str | None = None
        self.enabled_while_training: set[bool] = set()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.where = "between steps"
        self.enabled_while_training.add(gc.isenabled())
        trainer.optimizers[0].register_step_post_hook(self.stepped)

    def on_train_batch_start(self, *args: Any) -> None:
        self.where = "in a step"

    def stepped(self, *args: Any) -> None:
        self.where = "between steps"

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.where = None

    def count(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and self.where is not None:
            self.counted[(self.where, info["generation"])] += 1


@pytest.fixture
def collections() -> Iterator[Collections]:
    """The collections of the test's fit, counted; Python's own collect at 10 new objects instead of 700,
    so that one happens in every step that leaves some (how many a step of the tiny model leaves depends
    on what the process ran before: caches warmed by earlier tests leave too few in 6 steps)."""
    counter = Collections()
    thresholds = gc.get_threshold()
    gc.set_threshold(10, *thresholds[1:])
    gc.callbacks.append(counter.count)
    yield counter
    gc.callbacks.remove(counter.count)
    gc.set_threshold(*thresholds)


def run_overrides(corpus_root: Path, cache_dir: Path, *extra: str) -> list[str]:
    # One validation, after the last step (the run's final validation and test come after the fit).
    extra = (f"trainer.max_steps={STEPS}", f"checkpoint.every_steps={STEPS}", "decoding.max_len_offset=3", *extra)
    return resumable_run(corpus_root, cache_dir, *extra, pairs=500, eval_pairs=4)


def test_collections_run_on_schedule_between_steps_and_the_collector_is_restored(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, collections: Collections
) -> None:
    assert gc.isenabled() and gc.get_freeze_count() == 0
    overrides = run_overrides(corpus_root, cache_dir, "gc_every=2")
    results = train(compose_run_config(overrides), tmp_path / "run", overrides, callbacks=[collections])
    assert results["steps"] == STEPS
    # After steps 2, 4 and 6 the young generations; after the validation of step 6 all unfrozen objects.
    assert collections.counted == {("between steps", 1): 3, ("between steps", 2): 1}
    assert collections.enabled_while_training == {False}
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_without_a_schedule_python_collects_by_itself_in_the_middle_of_steps(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, collections: Collections
) -> None:
    overrides = run_overrides(corpus_root, cache_dir, "gc_every=null")
    train(compose_run_config(overrides), tmp_path / "run", overrides, callbacks=[collections])
    assert collections.enabled_while_training == {True}
    assert collections.counted[("in a step", 0)] >= STEPS  # what the schedule avoids


def test_a_fit_that_fails_restores_the_collector(tmp_path: Path, corpus_root: Path, cache_dir: Path) -> None:
    class Failing(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                assert not gc.isenabled() and gc.get_freeze_count() > 0
                raise RuntimeError("failed at step 3")

    overrides = run_overrides(corpus_root, cache_dir, "gc_every=2")
    with pytest.raises(RuntimeError, match="failed at step 3"):
        train(compose_run_config(overrides), tmp_path / "run", overrides, callbacks=[Failing()])
    assert gc.isenabled() and gc.get_freeze_count() == 0


@pytest.mark.parametrize("every", [0, -5, 2.5, "often"])
def test_a_schedule_that_is_not_a_positive_whole_number_of_steps_is_refused_naming_the_key(every: Any) -> None:
    with pytest.raises(FieldError, match=r"^every=\S+ must be a whole number of optimizer steps >= 1"):
        ScheduledCollection(every)
