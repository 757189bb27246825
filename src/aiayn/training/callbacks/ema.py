"""An exponential moving average (EMA) of the weights, kept beside training and tested at its end.

After every optimizer step, ``ema = decay * ema + (1 - decay) * weights`` for every parameter (one
``torch._foreach_lerp_`` call over all of them, in place), in fp32 whatever the model's precision.
The paper averages the last checkpoints instead (§6.1, :func:`~aiayn.training.checkpoints.average_checkpoints`);
the EMA is the running form of that average, with a horizon of about ``1 / (1 - decay)`` steps.

- A step the non-finite guard skipped (:mod:`.faults`) changed no weight, yet the EMA takes its step toward
  the unchanged weights: the EMA counts optimizer steps as the learning-rate schedule does, so its state
  after step ``s`` is a function of the weights of steps ``<= s``, whatever was skipped.
- Under DDP every rank holds the same weights after a step, so every rank computes the same EMA; no
  communication is needed, and the checkpoint (written by rank 0) holds it once.
- It is part of every checkpoint (the callback's state): a resumed run continues the very same EMA, and
  :mod:`aiayn.training.restored_state` checks it against the model before it is restored.
- Validation uses the raw weights: the checkpoints it ranks (``best.ckpt``) hold the raw weights, which an
  EMA's score would not describe. :func:`ema_checkpoint` turns the final checkpoint into
  ``checkpoints/ema.ckpt``, which the run tests and which every command takes as any checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch

from aiayn.errors import FieldError, is_number, whole
from aiayn.training.checkpoints import RUN_KEY
from aiayn.training.saved_state import Fields, shape_of, short

# What an evaluation checkpoint keeps of the final one: no training state (ema.ckpt is not resumed).
EVALUATION_KEYS = ("epoch", "global_step", "pytorch-lightning_version", "hparams_name", "hyper_parameters", RUN_KEY)


@dataclass(frozen=True)
class EmaSettings:
    """The ``ema`` section: ``decay`` per optimizer step (None or 0: no EMA, the paper's setting) and
    ``start_step``, the step whose weights the average starts from (until then it copies them)."""

    decay: float | None = None
    start_step: int = 0

    def __post_init__(self) -> None:
        if self.decay is not None and not (is_number(self.decay) and 0 <= self.decay < 1):
            raise FieldError("decay", self.decay, "must lie in [0, 1) (e.g. 0.999), or be null or 0 for no EMA")
        if not whole(self.start_step, 0):
            raise FieldError("start_step", self.start_step, "must be a whole number of steps >= 0")

    def callback(self) -> ExponentialMovingAverage | None:
        """The callback that keeps the EMA, or None when it is off."""
        return ExponentialMovingAverage(self.decay, self.start_step) if self.decay else None


class ExponentialMovingAverage(pl.Callback):
    """Keeps an fp32 EMA of every parameter of the module it trains, on the parameters' device, updated
    after each optimizer step: after step ``s`` (``trainer.global_step``) it is a copy of the weights while
    ``s <= start_step``, then ``decay * ema + (1 - decay) * weights``. It starts from the initial weights
    (or from those of the checkpoint a run continues, when that has no EMA). The module's buffers are
    not averaged: the model's one buffer is the fixed sinusoid table (§3.5), which checkpoints omit."""

    def __init__(self, decay: float, start_step: int = 0) -> None:
        self.decay, self.start_step = decay, start_step
        self.weights: dict[str, torch.Tensor] | None = None  # parameter name → its EMA
        self._parameters: list[torch.Tensor] = []
        self._step: int | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Here the module is on its device and a continued run's state is restored (load_state_dict).
        named = dict(pl_module.named_parameters())
        self._parameters = list(named.values())
        restored = self.weights or {name: parameter.detach() for name, parameter in named.items()}
        self.weights = {
            name: restored[name].to(device=parameter.device, dtype=torch.float32, copy=True)
            for name, parameter in named.items()
        }
        self._step = trainer.global_step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Before the checkpoint writers (Lightning runs them last), so a checkpoint of this step holds it.
        if trainer.global_step == self._step:
            return  # in the middle of a gradient accumulation: no optimizer step yet
        self._step = trainer.global_step
        self.update(trainer.global_step)

    @torch.no_grad()
    def update(self, step: int) -> None:
        """The EMA after optimizer step ``step``."""
        averages = list(self.weights.values())
        weights = [p.detach() if p.dtype == torch.float32 else p.detach().float() for p in self._parameters]
        if step <= self.start_step:
            torch._foreach_copy_(averages, weights)
        else:
            torch._foreach_lerp_(averages, weights, 1 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights or {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weights = state["weights"]  # checked by checked_state; moved to the device at on_fit_start

    def checked_state(
        self, state: Any, fields: Fields, name: str, trainer: pl.Trainer, module: pl.LightningModule
    ) -> Any:
        """The EMA as :meth:`state_dict` saves it: an fp32 tensor of finite numbers for each of ``module``'s
        parameters, of its shape (a NaN would reach ema.ckpt and every later step)."""
        parameters = dict(module.named_parameters())
        weights = fields.mapping(f"{name}.weights", fields.mapping(name, state, keys=("weights",))["weights"])
        for key in sorted(set(parameters) ^ set(weights), key=str):
            present = "present" if key in weights else "missing"
            raise fields.error(f"{name}.weights[{short(key)}]", present, "differs from this run's parameters")
        for key, tensor in weights.items():
            own = tuple(parameters[key].shape)
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32 or tuple(tensor.shape) != own:
                shown = (
                    f"{tensor.dtype} {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else shape_of(tensor)
                )
                raise fields.error(f"{name}.weights[{key}]", shown, f"is not its parameter's shape {own} in float32")
            if not torch.isfinite(tensor).all():
                raise fields.error(f"{name}.weights[{key}]", "its values", "are not all finite")
        return state


def ema_checkpoint(checkpoint: dict[str, Any], state_key: str) -> dict[str, Any]:
    """``checkpoint`` (a run's final one, with the EMA's state under ``callbacks[state_key]``) as a
    checkpoint for evaluation: the EMA in place of each parameter (in the parameter's dtype; names tied
    to one tensor, §3.4's shared embeddings, share the EMA's), no training state."""
    averages = checkpoint["callbacks"][state_key]["weights"]
    weights = checkpoint["state_dict"]
    by_storage = {_storage(weights[name]): average.to(weights[name].dtype) for name, average in averages.items()}
    result = {key: value for key, value in checkpoint.items() if key in EVALUATION_KEYS}
    result["state_dict"] = {name: by_storage.get(_storage(tensor), tensor) for name, tensor in weights.items()}
    return result


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset()
