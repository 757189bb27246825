"""A Lightning callback that marks the phases of a run in ``<folder>/phases.jsonl`` (a training batch, a
validation batch, a checkpoint being written, a test batch), pausing briefly in each so that a test can
kill the process inside the phase it waits for."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl


class PhaseMarker(pl.Callback):
    def __init__(self, folder: str, pause: float = 0.05) -> None:
        self.path = Path(folder) / "phases.jsonl"
        self.pause = pause

    def _mark(self, phase: str, trainer: pl.Trainer) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as out:
            out.write(json.dumps({"phase": phase, "step": trainer.global_step, "pid": os.getpid()}) + "\n")
        time.sleep(self.pause)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._mark("train", trainer)

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int, dataloader_idx: int = 0
    ) -> None:
        self._mark("validation", trainer)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self._mark("save", trainer)  # the file is written right after the hooks

    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int, dataloader_idx: int = 0
    ) -> None:
        self._mark("test", trainer)
