"""A Lightning callback that records which sentence pairs each training batch held, per rank.

Tests add it to real runs (in process, or on the command line through ``callbacks=[...]``) to check
what the sampler gave each DDP rank and where a resumed run continued, and to hold a run at a step
until they have signalled it (:func:`hold_and_signal`): a signal then lands at a known step, and no
test sleeps to give it time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

HELD, RELEASE = "held", "release"  # files in the recorder's folder
HOLD_TIMEOUT = 600.0


class BatchRecorder(pl.Callback):
    """Appends ``{"rank", "step", "epoch", "index"}`` per training batch to ``<folder>/batches.rank<r>.jsonl``.

    With ``hold_at=N`` every rank, after the N-th training batch of this process, writes ``<folder>/held``
    and waits until ``<folder>/release`` exists."""

    def __init__(self, folder: str, hold_at: int | None = None) -> None:
        self.folder = Path(folder)
        self.hold_at = hold_at
        self.batches = 0

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
        self.batches += 1
        if self.batches != self.hold_at:
            return
        # Written whole, then renamed (each DDP rank its own draft): the test reads the step once it exists.
        draft = self.folder / f"{HELD}.rank{trainer.global_rank}"
        draft.write_text(str(trainer.global_step))
        draft.replace(self.folder / HELD)
        deadline = time.monotonic() + HOLD_TIMEOUT
        while not (self.folder / RELEASE).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.folder / RELEASE} never came")
            time.sleep(0.01)


def recorded(folder: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = folder / f"batches.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def recorder(folder: Path, hold_at: int | None = None) -> str:
    """The ``callbacks=[...]`` override that adds a :class:`BatchRecorder` to an ``aiayn-train`` command."""
    hold = f",hold_at:{hold_at}" if hold_at is not None else ""
    return f"callbacks=[{{_target_:helpers.batch_recorder.BatchRecorder,folder:'{folder}'{hold}}}]"
