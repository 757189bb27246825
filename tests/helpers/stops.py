"""A Lightning callback that stops a run early, as Lightning's timer does when ``trainer.max_time`` runs out."""

from __future__ import annotations

import pytorch_lightning as pl


class StopAtStep(pl.Callback):
    """Asks the trainer to stop after ``step`` optimizer steps, as Lightning's timer does at max_time."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True
