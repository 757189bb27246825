"""Lightning callbacks of a training run."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Checkpoint, RichProgressBar

from aiayn.checkpoints import RUN_KEY
from aiayn.hardware import device_name, peak_flops
from aiayn.model import batch_training_flops

log = logging.getLogger(__name__)
PROGRESS_NAMES = {"train/loss": "loss", "train/tokens_per_s": "tok/s", "val/bleu": "BLEU"}


def metrics_flushed_at(trainer: pl.Trainer, step: int) -> bool:
    """Whether Lightning sends the step metrics to the loggers once the optimizer has made ``step``
    steps: at multiples of ``trainer.log_every_n_steps``, never in the middle of an accumulation."""
    n = trainer.log_every_n_steps
    return n > 0 and step % n == 0


class TokenThroughput(pl.Callback):
    """Logs ``train/tokens_per_s``, real (non-padding) source + target tokens per second of training, and
    ``train/mfu``, model-FLOPs utilisation of the device, when its peak FLOP/s are known.

    Under DDP both are for all ranks together (:func:`summed_over_ranks`). Time spent in validation is
    excluded; data loading between steps is included, since a user waits for it. ``tokens`` and
    ``seconds`` accumulate over this rank's run; ``all_tokens`` and ``tokens_per_s`` are all ranks' at
    the end. ``peak_tflops`` overrides the peak looked up from the device name (:data:`aiayn.hardware.PEAK_TFLOPS`).
    """

    def __init__(self, peak_tflops: float | None = None) -> None:
        self.peak_tflops = peak_tflops
        self.peak: float | None = None
        self.tokens = 0
        self.seconds = 0.0
        self.all_tokens = 0  # all ranks' tokens and tokens per second, at the end of training
        self.tokens_per_s = 0.0
        self._window_tokens = 0
        self._window_flops = 0.0
        self._window_seconds = 0.0
        self._last: float | None = None
        self._step = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        name = device_name(trainer.strategy.root_device)
        self.peak = peak_flops(name, str(trainer.precision), self.peak_tflops)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = time.perf_counter()  # a run resumed mid-epoch starts no epoch

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
        lengths = torch.from_numpy(batch["lengths"])  # on the CPU: no wait for the device
        tokens = int(lengths.sum())
        elapsed = now - self._last
        self._last = now
        self.tokens += tokens
        self.seconds += elapsed
        self._window_tokens += tokens
        self._window_seconds += elapsed
        if self.peak is not None:
            self._window_flops += batch_training_flops(pl_module.model.cfg, lengths[:, 0], lengths[:, 1])
        # The window spans exactly the batches between two flushes of the step metrics to the loggers.
        stepped = trainer.global_step != self._step
        self._step = trainer.global_step
        # Every rank decides alike here: the sum over ranks is a collective.
        if stepped and metrics_flushed_at(trainer, trainer.global_step):
            seconds = max(self._window_seconds, 1e-9)  # each rank's rates over its own time, summed over ranks
            rates = (self._window_tokens / seconds, self._window_flops / seconds)
            tokens, flops = summed_over_ranks(trainer, pl_module, *rates)
            pl_module.log("train/tokens_per_s", tokens, batch_size=1, prog_bar=True)
            if self.peak is not None:
                pl_module.log("train/mfu", flops / (self.peak * trainer.world_size), batch_size=1)
            self._window_tokens, self._window_flops, self._window_seconds = 0, 0.0, 0.0

    def state_dict(self) -> dict[str, Any]:
        # Totals continue over a resume: results.json counts the whole run, not its last part.
        return {"ranks": gathered_from_ranks({"tokens": self.tokens, "seconds": self.seconds})}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        totals = own_share(saved["ranks"])
        self.tokens, self.seconds = int(totals["tokens"]), float(totals["seconds"])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The run's figures for results.json, all ranks' (each rank timed its own share).
        rate = self.tokens / self.seconds if self.seconds else 0.0
        tokens, self.tokens_per_s = summed_over_ranks(trainer, pl_module, self.tokens, rate)
        self.all_tokens = round(tokens)


def summed_over_ranks(trainer: pl.Trainer, pl_module: pl.LightningModule, *values: float) -> list[float]:
    """``values`` summed over all DDP ranks: a collective, which every rank calls at the same step; a
    single process gets its own values back."""
    totals = torch.tensor(values, dtype=torch.float64)
    if trainer.world_size > 1:
        totals = trainer.strategy.reduce(totals.to(pl_module.device), reduce_op="sum").cpu()
    return totals.tolist()


class FinalCheckpoint(Checkpoint):
    """Writes ``path`` (``last.ckpt``) from inside the training loop at its last step (``max_steps``
    reached, or a callback such as Lightning's timer asked to stop).

    Saved there, the checkpoint holds the loader's position in the epoch and the progress counters
    as they are mid-epoch, so a run resumed from it continues with the next batch; a checkpoint saved
    after ``fit`` returns marks the epoch as finished instead. ``saved_step`` says whether it was written.
    As a :class:`~pytorch_lightning.callbacks.Checkpoint` it runs after the other callbacks, the timer
    of ``trainer.max_time`` included, and so sees their request to stop.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.saved_step: int | None = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        done = 0 < trainer.max_steps <= trainer.global_step
        if (done or trainer.should_stop) and self.saved_step != trainer.global_step:
            trainer.save_checkpoint(self.path, weights_only=False)  # the whole training state
            self.saved_step = trainer.global_step


class RandomState(pl.Callback):
    """Keeps the random number generators' states in checkpoints and restores them on resume.

    Dropout draws from them: without this, a resumed run would draw other masks than an uninterrupted
    one and end with other weights. The states are stored as tensors and ints, which
    ``torch.load(weights_only=True)`` accepts. Each DDP rank keeps and restores its own states.
    """

    def state_dict(self) -> dict[str, Any]:
        _, keys, position, has_gauss, gauss = np.random.get_state()
        state = {
            "torch": torch.get_rng_state(),
            "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "rest": [position, has_gauss, gauss]},
            "python": random.getstate(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()  # this rank's device
        return {"ranks": gathered_from_ranks(state)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state = own_share(saved["ranks"])
        torch.set_rng_state(state["torch"])
        position, has_gauss, gauss = state["numpy"]["rest"]
        np.random.set_state(("MT19937", state["numpy"]["keys"].numpy().astype(np.uint32), position, has_gauss, gauss))
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


def gathered_from_ranks(value: Any) -> list[Any]:
    """Every DDP rank's ``value``, in rank order: a collective, as Lightning's checkpoint saving is
    (every rank builds the checkpoint, rank 0 writes it); ``[value]`` in a single process."""
    if not distributed():
        return [value]
    values: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def own_share(values: list[Any]) -> Any:
    """This rank's entry of :func:`gathered_from_ranks`'s list; rank 0's when the run was saved on fewer
    ranks than it resumes on."""
    rank = torch.distributed.get_rank() if distributed() else 0
    return values[rank] if rank < len(values) else values[0]


def distributed() -> bool:
    """Whether this process is one of several DDP ranks."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


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
    per second and the latest validation BLEU."""

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        return {PROGRESS_NAMES.get(key, key): value for key, value in metrics.items() if key != "v_num"}
