"""Non-finite losses and gradients in the middle of a run: skipped, counted, and the run stopped when
they persist. The guard decides at optimizer-step boundaries and, under DDP, all ranks decide alike
(an all-reduce of two flags), so that every rank skips or stops at the same step.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from aiayn.errors import TrainingDiverged
from aiayn.training.callbacks.cadence import metrics_flushed_at
from aiayn.training.distributed import max_over_ranks

log = logging.getLogger(__name__)
MIN_LOSS_SCALE = 1e-4  # fp16: a scaler this low means gradients overflow at any scale (fairseq's floor too)


class NonFiniteGuard(pl.Callback):
    """Skips the optimizer steps whose loss or gradients are not finite, and stops the run with
    :class:`~aiayn.errors.TrainingDiverged` after ``limit`` such steps in a row.

    A skipped step changes no weight and no Adam moment (its gradients are dropped), so the weights and
    every checkpoint stay finite; the step still counts (the schedule moves on). Under fp16 mixed
    precision, gradients that overflow with a finite loss are the gradient scaler's to handle: it skips
    the step and halves its scale; those steps are counted as ``overflows``, not as faults, unless the
    scale falls below :data:`MIN_LOSS_SCALE` (the gradients overflow whatever the scale: the run stops).

    The guard computes the global gradient norm of every step (one pass over the gradients, one host
    synchronisation) and logs it as ``train/grad_norm`` at the steps whose metrics reach the loggers.
    """

    def __init__(self, limit: int, last_checkpoint: Path) -> None:
        self.limit, self.last_checkpoint = limit, last_checkpoint
        self.skipped = 0  # steps skipped for a non-finite loss or gradient, over the whole run
        self.overflows = 0  # fp16 steps the gradient scaler skipped
        self.in_a_row = 0
        self._loss_bad: torch.Tensor | None = None  # any micro-batch of this step had a non-finite loss

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach())  # stays on the device: no wait here
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # The (unscaled) gradients before any clipping; under DDP already averaged over the ranks.
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=pl_module.device)
        loss_bad = self._loss_bad if self._loss_bad is not None else torch.zeros((), dtype=torch.bool)
        self._loss_bad = None
        flags = torch.stack([loss_bad.to(norm.device), ~torch.isfinite(norm)])
        loss_bad, grad_bad = map(bool, max_over_ranks(flags, norm.device))  # losses differ by rank, gradients not
        step = trainer.global_step + 1
        if metrics_flushed_at(trainer, step):
            pl_module.log("train/grad_norm", norm, batch_size=1)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if grad_bad and not loss_bad and scaler is not None:
            self.overflows += 1  # the scaler finds the infinities itself, skips this step and halves its scale
            scale = scaler.get_scale()
            if scale / 2 < MIN_LOSS_SCALE:
                raise TrainingDiverged(self._diverged(step, f"fp16 gradients at a loss scale of {scale:g}"))
        elif loss_bad or grad_bad:
            for parameter in pl_module.parameters():
                parameter.grad = None  # Adam steps only parameters that have gradients: none
            self.skipped += 1
            self.in_a_row += 1
            what = "loss" if loss_bad else "gradients"
            log.warning("step %d: non-finite %s; the update was skipped (%d in a row)", step, what, self.in_a_row)
            if self.in_a_row >= self.limit:
                raise TrainingDiverged(self._diverged(step, f"{what} at {self.in_a_row} optimizer steps in a row"))
        else:
            self.in_a_row = 0
        pl_module.log("train/skipped_steps", float(self.skipped), batch_size=1)
        if scaler is not None:
            pl_module.log("train/overflow_steps", float(self.overflows), batch_size=1)

    def _diverged(self, step: int, what: str) -> str:
        kept = (
            f"{self.last_checkpoint} is kept, with weights from before the faults"
            if self.last_checkpoint.is_file()
            else "no checkpoint had been written yet"
        )
        return (
            f"training stopped at step {step}: non-finite {what} (max_nonfinite_steps={self.limit}); {kept}. "
            "Lower optim.lr_scale, raise optim.warmup, set trainer.gradient_clip_val, or train in bf16-mixed "
            "or 32-true instead of 16-mixed"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "overflows": self.overflows, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped, self.overflows, self.in_a_row = state["skipped"], state["overflows"], state["in_a_row"]
