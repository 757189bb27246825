"""What each DDP rank did with the weights-only step checkpoints (``checkpoint.average_every``): given to a DDP
``aiayn-train`` process as ``callbacks=[...]``, it writes ``<folder>/snapshots.rank<r>.json`` at the end of
training: whether the rank took snapshots (has a writer) and how many files it wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytorch_lightning as pl

from aiayn.training.callbacks.checkpointing import StepCheckpoints


class SnapshotsPerRank(pl.Callback):
    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (steps,) = [callback for callback in trainer.callbacks if isinstance(callback, StepCheckpoints)]
        steps._flush()
        writer = steps._writer
        record = {"writer": writer is not None, "written": writer.written if writer is not None else 0}
        (self.folder / f"snapshots.rank{trainer.global_rank}.json").write_text(json.dumps(record))
