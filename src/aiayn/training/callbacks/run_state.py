"""What every checkpoint of a run carries beyond Lightning's own state: the random generators' states
(so that a resumed run draws the dropout masks an uninterrupted one would) and the run's config and
tokenizer (so that one ``.ckpt`` file is enough to translate)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from aiayn.errors import whole
from aiayn.training.batching import batch_layout
from aiayn.training.checkpoints import BATCH_KEY, DATA_KEY, OVERRIDES_KEY, RUN_KEY
from aiayn.training.distributed import gathered_from_ranks, own_share
from aiayn.training.saved_state import Fields, short


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

    def checked_state(
        self, state: Any, fields: Fields, name: str, trainer: pl.Trainer, module: pl.LightningModule
    ) -> Any:
        """Each rank's generators as :meth:`state_dict` saves them, tried on scratch generators (each library
        checks its own format) before the run's are set."""
        for i, share in enumerate(fields.shares(name, state, max(trainer.world_size, 1))):
            _check_generators(fields, f"{name}.ranks[{i}]", share)
        return state


def _check_generators(fields: Fields, name: str, share: Any) -> None:
    share = fields.mapping(name, share)
    if set(share) - {"torch", "numpy", "python", "cuda"} or {"torch", "numpy", "python"} - set(share):
        raise fields.error(name, sorted(map(str, share)), "are not the generators RandomState saves")
    try:
        torch.Generator().set_state(share["torch"])
        numpy = fields.mapping(f"{name}.numpy", share["numpy"], keys=("keys", "rest"))
        position, has_gauss, gauss = fields.sequence(f"{name}.numpy.rest", numpy["rest"], length=3)
        keys = numpy["keys"]
        if not isinstance(keys, torch.Tensor) or keys.shape != (624,) or not whole(position, 0):
            raise ValueError("numpy.keys")
        np.random.RandomState().set_state(("MT19937", keys.numpy().astype(np.uint32), position, has_gauss, gauss))
        version, internal, gauss_next = fields.sequence(f"{name}.python", share["python"], length=3)
        random.Random().setstate((version, tuple(fields.sequence(f"{name}.python[1]", internal)), gauss_next))
        if "cuda" in share:
            cuda = share["cuda"]
            if not (isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8 and cuda.dim() == 1):
                raise ValueError("cuda")
            size = torch.cuda.get_rng_state().numel() if torch.cuda.is_available() else cuda.numel()
            if cuda.numel() != size:
                raise ValueError(f"cuda state of {cuda.numel()} bytes, not {size}")
    except (TypeError, ValueError, RuntimeError, OverflowError) as error:
        raise fields.error(name, short(error), "is not a generator state") from None


class SelfContainedCheckpoints(pl.Callback):
    """Stores the run's resolved config, its overrides, the name of its data's cache entry and the
    tokenizer in every checkpoint (under ``RUN_KEY``).

    With them one ``.ckpt`` file is enough for ``aiayn-translate`` and ``aiayn-eval``: the model is
    rebuilt from the hyperparameters, the text is encoded with the very BPE model it was trained on;
    and a resume can tell whether it continues the same training (:mod:`aiayn.experiments.resume`).
    Before a checkpoint is written the loggers write out what they hold, so that every metric the
    checkpoint has seen is on disk with it (a run killed later continues after them).
    """

    def __init__(self, config: dict[str, Any], overrides: Sequence[str] = ()) -> None:
        self.config, self.overrides = config, list(overrides)
        self._tokenizer: bytes | None = None

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._tokenizer is None:
            self._tokenizer = trainer.datamodule.tokenizer.to_bytes()
        checkpoint[RUN_KEY] = {
            "config": self.config,
            "tokenizer": self._tokenizer,
            OVERRIDES_KEY: self.overrides,
            DATA_KEY: trainer.datamodule.cache_folder().name,
            BATCH_KEY: batch_layout(trainer),
        }
        for logger in trainer.loggers:
            logger.save()
