"""What a run prints while it trains: Rich's progress bar with the run's vital signs, or (``quiet``: CI,
SLURM and nohup logs) one log line per validation."""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import RichProgressBar

from aiayn.errors import FieldError
from aiayn.training.callbacks.cadence import metrics_flushed_at

log = logging.getLogger(__name__)
PROGRESS_NAMES = {"train/loss": "loss", "train/tokens_per_s": "tok/s", "val/bleu": "BLEU"}
PROGRESS_STYLES = ("auto", "rich", "tqdm", "quiet")  # quiet: no bar, one log line per validation (CI logs)


def progress_style(requested: str) -> str:
    """``rich``, ``tqdm`` or ``quiet``; ``auto`` is the rich bar on a terminal and quiet elsewhere (CI,
    SLURM and nohup logs, where a bar would print nothing until its end, or a line per refresh)."""
    if requested not in PROGRESS_STYLES:
        raise FieldError("progress", requested, f"is not a progress display; use one of {', '.join(PROGRESS_STYLES)}")
    if requested == "auto":
        return "rich" if sys.stdout.isatty() else "quiet"
    return requested


def progress_callbacks(style: str) -> list[pl.Callback]:
    """The callbacks that show a run's progress in ``style`` (:func:`progress_style`'s; tqdm is Lightning's own bar)."""
    return {"rich": [RunProgressBar()], "tqdm": [], "quiet": [ValidationReport()]}[style]


class ValidationReport(pl.Callback):
    """One log line per validation (step, loss, perplexity, BLEU, tokens/s): the quiet mode's progress,
    readable in CI logs where progress bars are noise."""

    KEYS = ("val/loss", "val/ppl", "val/bleu", "train/tokens_per_s")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        values = ", ".join(f"{key} {float(metrics[key]):.4g}" for key in self.KEYS if key in metrics)
        log.info("step %d: %s", trainer.global_step, values)


class RunProgressBar(RichProgressBar):
    """Rich's progress bar showing the run's vital signs under short names: the training loss, tokens
    per second and the latest validation BLEU. The training values are read on the host once a step's
    metrics reach the loggers (every ``trainer.log_every_n_steps``), not after every batch: each read
    makes the host wait for the device."""

    TRAINING_KEYS = ("train/loss", "train/tokens_per_s")

    def __init__(self) -> None:
        super().__init__()
        self.training_values: dict[str, float] = {}
        self._read_at: int | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # Lightning hands a step's metrics to the loggers after its batch ends; they are read here, before
        # the next step queues work on the device.
        step = trainer.global_step
        if step != self._read_at and metrics_flushed_at(trainer, step):
            self._read_at = step
            metrics = trainer.callback_metrics
            self.training_values = {key: float(metrics[key]) for key in self.TRAINING_KEYS if key in metrics}

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = {**super().get_metrics(trainer, pl_module), **self.training_values}
        return {PROGRESS_NAMES.get(key, key): value for key, value in metrics.items() if key != "v_num"}
