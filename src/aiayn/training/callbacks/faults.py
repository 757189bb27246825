"""Non-finite losses and gradients in the middle of a run: skipped, counted, and the run stopped when
they persist, without making the host wait for the device at every step.

Every optimizer step the guard computes, on the device, whether the step's loss (of any micro-batch) or
its gradients are not finite, and under DDP the largest of those flags over the ranks (an all-reduce of a
device tensor), so that every rank skips alike. Fused Adam (the module's optimizer on CPU and CUDA) takes
the flag as ``found_inf``, as torch's ``GradScaler`` hands it over: the fused kernel leaves the weights
and Adam's moments as they were and its step counter where it was. The counts (steps skipped, skipped
steps in a row) are device tensors too. The host reads them only where it waits for the device anyway: at
the steps whose metrics reach the loggers, before each validation of the fit and at the end of training,
where it warns and stops the run, and when a checkpoint is saved (which holds them exactly). A run whose
faults persist therefore stops at the first read after ``limit`` skipped steps in a row, not always at
the step that reached it; the steps in between are skipped too, so no weight changes after the first
fault.

Other optimizers (unfused Adam: fp16 with a gradient scaler, which reads its own flags on the host
every step anyway, or devices without the fused kernel) decide on the host at every step, as they
always did: they drop the step's gradients, and a run stops at the very step that reaches ``limit``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn

from aiayn.errors import TrainingDiverged
from aiayn.training.callbacks.cadence import metrics_flushed_at
from aiayn.training.distributed import device_max_over_ranks
from aiayn.training.saved_state import Fields

log = logging.getLogger(__name__)
MIN_LOSS_SCALE = 1e-4  # fp16: a scaler this low means gradients overflow at any scale (fairseq's floor too)


class NonFiniteGuard(pl.Callback):
    """Skips the optimizer steps whose loss or gradients are not finite, and stops the run with
    :class:`~aiayn.errors.TrainingDiverged` once ``limit`` such steps came in a row (at the next read of
    its counts, see the module's docstring).

    A skipped step changes no weight and no Adam moment, so the weights and every checkpoint stay
    finite; the step still counts (the schedule moves on). Under fp16 mixed precision, gradients that
    overflow with a finite loss are the gradient scaler's to handle: it skips the step and halves its
    scale; those steps are counted as ``overflows``, not as faults, unless the scale falls below
    :data:`MIN_LOSS_SCALE` (the gradients overflow whatever the scale: the run stops).

    The guard computes the global gradient norm of every step (one pass over the gradients) and logs
    it as ``train/grad_norm`` at the steps whose metrics reach the loggers.
    """

    def __init__(self, limit: int, last_checkpoint: Path) -> None:
        self.limit, self.last_checkpoint = limit, last_checkpoint
        self.overflows = 0  # fp16 steps the gradient scaler skipped
        # Steps skipped over the whole run, skipped steps in a row, and whether the loss of the latest
        # skipped step was non-finite (else only its gradients were): a device tensor while training,
        # read into ``_read`` on the host (:meth:`_counts_read`).
        self._counts: torch.Tensor | None = None
        self._read = [0, 0, 0]
        self._loss_bad: torch.Tensor | None = None  # any micro-batch of this step had a non-finite loss
        self._flagged: torch.optim.Optimizer | None = None  # holds this step's ``found_inf``
        self._reported = (0, 0)  # the skipped steps and the global step at the latest check

    @property
    def skipped(self) -> int:
        """Optimizer steps skipped for a non-finite loss or gradients, over the whole run (a host read)."""
        return self._counts_read()[0]

    @property
    def in_a_row(self) -> int:
        """Skipped optimizer steps since the last good one (a host read)."""
        return self._counts_read()[1]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reported = (self._read[0], trainer.global_step)  # a resumed run warns of its own skips only

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach())  # stays on the device: no wait here
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # The (unscaled) gradients before any clipping; under DDP already averaged over the ranks.
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=pl_module.device)
        loss_bad = (
            self._loss_bad if self._loss_bad is not None else torch.zeros((), dtype=torch.bool, device=norm.device)
        )
        self._loss_bad = None
        # (loss, gradients); losses differ by rank, gradients not: every rank gets the largest flags
        flags = device_max_over_ranks(torch.stack([loss_bad, ~torch.isfinite(norm)]).float())
        step = trainer.global_step + 1
        if metrics_flushed_at(trainer, step):
            pl_module.log("train/grad_norm", norm, batch_size=1)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        # torch's own test of whether an optimizer takes ``found_inf`` (GradScaler.step makes it too).
        if scaler is None and getattr(optimizer, "_step_supports_amp_scaling", False):
            bad = flags.amax()
            optimizer.found_inf = bad  # 1.0: the fused step changes nothing, its step counter included
            self._flagged = optimizer
            self._count(bad, flags[0])
        else:
            self._decide_on_host(pl_module, scaler, flags, step)
        pl_module.log("train/skipped_steps", self._counts[0].float(), batch_size=1)  # read only when flushed
        if scaler is not None:
            pl_module.log("train/overflow_steps", float(self.overflows), batch_size=1)

    def _decide_on_host(self, pl_module: pl.LightningModule, scaler: Any, flags: torch.Tensor, step: int) -> None:
        """The path of optimizers without ``found_inf``, or with fp16's gradient ``scaler``: the host reads
        the flags and drops the gradients."""
        loss_bad, grad_bad = (flag > 0 for flag in flags.tolist())
        if grad_bad and not loss_bad and scaler is not None:
            self.overflows += 1  # the scaler finds the infinities itself, skips this step and halves its scale
            scale = scaler.get_scale()
            if scale / 2 < MIN_LOSS_SCALE:
                raise TrainingDiverged(self._diverged(step, f"fp16 gradients at a loss scale of {scale:g}"))
            self._device_counts(flags.device)  # neither a fault nor a good step: the counts stay
            return
        if loss_bad or grad_bad:
            for parameter in pl_module.parameters():
                parameter.grad = None  # Adam steps only parameters that have gradients: none
        self._count(flags.amax(), flags[0])
        self._check(step)  # the host has waited already: it decides now

    def _device_counts(self, device: torch.device) -> torch.Tensor:
        """The counts as a device tensor; made from the host's (the start, a restored checkpoint) once,
        filled in place on the device (a copy from the host would make the host wait for it)."""
        if self._counts is None:
            self._counts = torch.stack([torch.full((), count, device=device) for count in self._read])
        return self._counts

    def _count(self, bad: torch.Tensor, loss_bad: torch.Tensor) -> None:
        """The counts after a step that was skipped (``bad`` 1.0) or not (0.0), computed on the device."""
        skipped, in_a_row, latest = self._device_counts(bad.device)
        skip = bad.long()
        latest = torch.where(bad > 0, loss_bad.long(), latest)
        self._counts = torch.stack([skipped + skip, (in_a_row + 1) * skip, latest])

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._flagged is None:
            return  # in the middle of a gradient accumulation, or the host decided
        del self._flagged.found_inf  # it held for this step only, as GradScaler's does
        self._flagged = None
        if metrics_flushed_at(trainer, trainer.global_step):
            self._check(trainer.global_step)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._check(trainer.global_step)  # before a validation ranks, and a checkpoint keeps, this state

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check(trainer.global_step)

    def _counts_read(self) -> list[int]:
        """The counts on the host: here the host waits for the device."""
        if self._counts is not None:
            self._read = [int(count) for count in self._counts.tolist()]
        return self._read

    def _check(self, step: int) -> None:
        """Reads the counts after optimizer step ``step``, warns of the steps skipped since the previous
        check and stops the run after ``limit`` in a row. Every DDP rank holds the same counts."""
        skipped, in_a_row, loss_bad = self._counts_read()
        what = "loss" if loss_bad else "gradients"
        earlier, since = self._reported
        if skipped > earlier:
            log.warning(
                "steps %d-%d: %d optimizer step(s) had a non-finite loss or gradients and were skipped "
                "(%d in a row at step %d)", since + 1, step, skipped - earlier, in_a_row, step,
            )  # fmt: skip
        self._reported = (skipped, step)
        if in_a_row >= self.limit:
            raise TrainingDiverged(self._diverged(step, f"{what} at {in_a_row} optimizer steps in a row"))

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
        skipped, in_a_row, _ = self._counts_read()
        return {"skipped": skipped, "overflows": self.overflows, "in_a_row": in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._counts, self._read = None, [state["skipped"], state["in_a_row"], 0]
        self.overflows = state["overflows"]

    def checked_state(
        self, state: Any, fields: Fields, name: str, trainer: pl.Trainer, module: pl.LightningModule
    ) -> Any:
        """The counts :meth:`state_dict` saves, whole numbers."""
        state = fields.mapping(name, state, keys=("skipped", "overflows", "in_a_row"))
        for key in state:
            fields.count(f"{name}.{key}", state[key])
        return state
