"""A Lightning callback that records which sentence pairs each training batch held, per rank.

Tests add it to real runs (in process, or on the command line through ``callbacks=[...]``) to check
what the sampler gave each DDP rank and where a resumed run continued.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl


class BatchRecorder(pl.Callback):
    """Appends ``{"rank", "step", "epoch", "index"}`` per training batch to ``<folder>/batches.rank<r>.jsonl``;
    ``pause`` seconds after each batch give a test time to signal the process mid-run."""

    def __init__(self, folder: str, pause: float = 0.0) -> None:
        self.folder = Path(folder)
        self.pause = pause

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {
            "rank": trainer.global_rank,
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "index": batch["index"].tolist(),
        }
        with open(self.folder / f"batches.rank{trainer.global_rank}.jsonl", "a") as out:
            out.write(json.dumps(record) + "\n")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        time.sleep(self.pause)


def recorded(folder: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = folder / f"batches.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
