"""Every batch shape of training met once before the first step, when the batches take few shapes
(``data.batch_shapes``). What a new tensor shape costs is paid when it is first met: the caching
allocator's blocks, cuBLASLt's algorithm choice, oneDNN's kernels on a CPU, a compiled region's
compilation. Met in the first epoch, those costs make its steps slow by turns (the H200 measurement's
5-step windows swung 10x); met here, largest first so that the allocator's first blocks fit every later
batch, the run's steps all start warm. NVIDIA's Transformer recipe warms up the same way, with a dummy
batch of the largest size."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from aiayn.data.sampler import BatchShapes
from aiayn.training.module import TranslationModule

log = logging.getLogger(__name__)


class ShapeWarmUp(pl.Callback):
    """Before training, one forward and backward pass of the training step on a batch of each of the
    training batches' shapes (:class:`~aiayn.data.sampler.BatchShapes`), largest first; nothing when the
    batches take their own lengths. The run is left as it was: no optimizer step, gradients cleared, the
    random number generators restored (dropout draws from them), no metric logged."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: TranslationModule) -> None:
        loader = trainer.train_dataloader
        shapes = getattr(getattr(loader, "batch_sampler", None), "shapes", None)
        if not isinstance(shapes, BatchShapes):
            return
        start = time.perf_counter()
        cuda = [pl_module.device] if pl_module.device.type == "cuda" else []
        # Outside DDP's forward its reducer expects no gradients; no_sync says so where a wrapper has it.
        no_sync = getattr(trainer.strategy.model, "no_sync", nullcontext)
        with torch.random.fork_rng(devices=cuda), no_sync():
            for shape in np.argsort(-(shapes.rows * shapes.widths.sum(axis=1)), kind="stable").tolist():
                batch = dummy_batch(shapes, shape, pl_module.hparams.eos_id, loader.collate_fn)
                batch = trainer.strategy.batch_to_device(batch)
                with trainer.precision_plugin.train_step_context():
                    loss, _ = pl_module.training_loss(batch)
                loss.backward()
        pl_module.zero_grad(set_to_none=True)
        if trainer.is_global_zero:
            log.info("met the %d training batch shapes in %.1f s", len(shapes), time.perf_counter() - start)


def dummy_batch(shapes: BatchShapes, shape: int, token: int, collate: Callable[[list[Any]], Any]) -> dict[str, Any]:
    """A training batch of shape number ``shape``: its rows of pairs of ``token`` (any id of the vocabulary:
    the kernels do not depend on it) as long as its widths allow, collated as the run's batches are (source
    + EOS and BOS + target fill the widths)."""
    rows = int(shapes.rows[shape])
    src_len, tgt_len = (int(width) for width in shapes.widths[shape])
    pair = (0, np.full(src_len - 1, token, dtype=np.int64), np.full(tgt_len - 1, token, dtype=np.int64))
    return collate([pair] * rows)
