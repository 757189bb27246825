"""Training speed as the dashboard shows it: real tokens per second and model-FLOPs utilisation; and at
each validation, how much training it follows: the tokens trained on and the seconds it took (the x axes
of the report's learning curves)."""

from __future__ import annotations

import time
from typing import Any

import pytorch_lightning as pl
import torch

from aiayn.machine import device_name, peak_flops
from aiayn.model import batch_training_flops
from aiayn.training.callbacks.cadence import metrics_flushed_at
from aiayn.training.distributed import gathered_from_ranks, own_share, summed_over_ranks
from aiayn.training.saved_state import Fields


class TokenThroughput(pl.Callback):
    """Logs ``train/tokens_per_s``, real (non-padding) source + target tokens per second of training, and
    ``train/mfu``, model-FLOPs utilisation of the device, when its peak FLOP/s are known.

    At each validation of a fit, ``train/tokens`` (all ranks' tokens trained on so far) and
    ``train/seconds`` (the training seconds so far, the ranks' mean), resumed parts included: a learning
    curve's x axis in tokens, minutes or FLOPs.

    Under DDP both rates are for all ranks together (:func:`~aiayn.training.distributed.summed_over_ranks`).
    Time spent in validation is excluded; data loading between steps is included, since a user waits
    for it. ``tokens`` and ``seconds`` accumulate over this rank's run; ``all_tokens`` and
    ``tokens_per_s`` are all ranks' at the end. ``peak_tflops`` overrides the peak looked up from the
    device name (:data:`aiayn.machine.PEAK_TFLOPS`).
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

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        tokens, seconds = summed_over_ranks((float(self.tokens), self.seconds), pl_module.device)
        pl_module.log("train/tokens", tokens, batch_size=1)
        pl_module.log("train/seconds", seconds / max(trainer.world_size, 1), batch_size=1)

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
            tokens, flops = summed_over_ranks(rates, pl_module.device)
            pl_module.log("train/tokens_per_s", tokens, batch_size=1)  # not prog_bar: see TranslationModule
            if self.peak is not None:
                pl_module.log("train/mfu", flops / (self.peak * trainer.world_size), batch_size=1)
            self._window_tokens, self._window_flops, self._window_seconds = 0, 0.0, 0.0

    def state_dict(self) -> dict[str, Any]:
        # Totals continue over a resume: results.json counts the whole run, not its last part.
        return {"ranks": gathered_from_ranks({"tokens": self.tokens, "seconds": self.seconds})}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        totals = own_share(saved["ranks"])
        self.tokens, self.seconds = int(totals["tokens"]), float(totals["seconds"])

    def checked_state(
        self, state: Any, fields: Fields, name: str, trainer: pl.Trainer, module: pl.LightningModule
    ) -> Any:
        """Each rank's totals as :meth:`state_dict` saves them: a token count and seconds."""
        for i, share in enumerate(fields.shares(name, state, max(trainer.world_size, 1))):
            share = fields.mapping(f"{name}.ranks[{i}]", share, keys=("tokens", "seconds"))
            fields.count(f"{name}.ranks[{i}].tokens", share["tokens"])
            fields.number(f"{name}.ranks[{i}].seconds", share["seconds"], minimum=0)
        return state

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The run's figures for results.json, all ranks' (each rank timed its own share).
        rate = self.tokens / self.seconds if self.seconds else 0.0
        tokens, self.tokens_per_s = summed_over_ranks((self.tokens, rate), pl_module.device)
        self.all_tokens = round(tokens)
