"""Lightning callbacks of a training run."""

from __future__ import annotations

import time
from typing import Any

import pytorch_lightning as pl

from aiayn.checkpoints import RUN_KEY


class TokenThroughput(pl.Callback):
    """Logs ``train/tokens_per_s``: real (non-padding) source + target tokens per second of training.

    Time spent in validation is excluded; data loading between steps is included, since a user waits
    for it. ``tokens`` and ``seconds`` accumulate over the run for its summary.
    """

    def __init__(self, pad_id: int = 0) -> None:
        self.pad_id = pad_id
        self.tokens = 0
        self.seconds = 0.0
        self._window_tokens = 0
        self._window_seconds = 0.0
        self._last: float | None = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._last is None:
            self._last = now
            return
        tokens = int(batch["src"].ne(self.pad_id).sum()) + int(batch["tgt_out"].ne(self.pad_id).sum())
        elapsed = now - self._last
        self._last = now
        self.tokens += tokens
        self.seconds += elapsed
        self._window_tokens += tokens
        self._window_seconds += elapsed
        if trainer.global_step % trainer.log_every_n_steps == 0 and self._window_seconds > 0:
            pl_module.log("train/tokens_per_s", self._window_tokens / self._window_seconds, batch_size=1)
            self._window_tokens, self._window_seconds = 0, 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class SelfContainedCheckpoints(pl.Callback):
    """Stores the run's resolved config and the tokenizer in every checkpoint (under ``RUN_KEY``).

    With them one ``.ckpt`` file is enough for ``aiayn-translate`` and ``aiayn-eval``: the model is
    rebuilt from the hyperparameters, the text is encoded with the very BPE model it was trained on.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self._tokenizer: bytes | None = None

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._tokenizer is None:
            self._tokenizer = trainer.datamodule.tokenizer.to_bytes()
        checkpoint[RUN_KEY] = {"config": self.config, "tokenizer": self._tokenizer}
