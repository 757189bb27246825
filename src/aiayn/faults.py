"""What a training run does when something goes wrong in the middle: non-finite losses or gradients,
and the signals a scheduler sends before it stops a job.

Both callbacks decide at optimizer-step boundaries and, under DDP, all ranks decide alike (a
one-element all-reduce), so that every rank skips, saves or stops at the same step.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Checkpoint

from aiayn.callbacks import distributed
from aiayn.errors import TrainingDiverged

log = logging.getLogger(__name__)
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # SLURM's preemption and its --signal warning


def any_rank(trainer: pl.Trainer, flags: torch.Tensor) -> list[bool]:
    """Each of ``flags`` (a float tensor on the module's device) true on any DDP rank; this rank's own in
    a single process. Every rank calls it at the same point: it is a collective under DDP."""
    if distributed() and trainer.world_size > 1:
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    return [bool(flag) for flag in flags.tolist()]


class NonFiniteGuard(pl.Callback):
    """Skips the optimizer steps whose loss or gradients are not finite, and stops the run with
    :class:`~aiayn.errors.TrainingDiverged` after ``limit`` such steps in a row.

    A skipped step changes no weight and no Adam moment (its gradients are dropped), so the weights and
    every checkpoint stay finite; the step still counts (the schedule moves on). Under fp16 mixed
    precision, gradients that overflow with a finite loss are the gradient scaler's to handle: it skips
    the step and lowers its scale; those steps are counted as ``overflows``, not as faults. The check
    costs one pass over the gradients and one host synchronisation per optimizer step.
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
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        grad_bad = ~torch.isfinite(torch.nn.utils.get_total_norm(grads)) if grads else torch.tensor(False)
        loss_bad = self._loss_bad if self._loss_bad is not None else torch.tensor(False)
        self._loss_bad = None
        flags = torch.stack([loss_bad.to(pl_module.device), grad_bad.to(pl_module.device)]).float()
        loss_bad, grad_bad = any_rank(trainer, flags)
        scaled = getattr(trainer.precision_plugin, "scaler", None) is not None
        step = trainer.global_step + 1
        if grad_bad and not loss_bad and scaled:
            self.overflows += 1  # the scaler finds the infinities itself and skips this step
        elif loss_bad or grad_bad:
            for parameter in pl_module.parameters():
                parameter.grad = None  # Adam steps only parameters that have gradients: none
            self.skipped += 1
            self.in_a_row += 1
            what = "loss" if loss_bad else "gradients"
            log.warning("step %d: non-finite %s; the update was skipped (%d in a row)", step, what, self.in_a_row)
            if self.in_a_row >= self.limit:
                raise TrainingDiverged(self._diverged(step, what))
        else:
            self.in_a_row = 0
        pl_module.log("train/skipped_steps", float(self.skipped), batch_size=1)
        if scaled:
            pl_module.log("train/overflow_steps", float(self.overflows), batch_size=1)

    def _diverged(self, step: int, what: str) -> str:
        kept = (
            f"{self.last_checkpoint} is kept, with weights from before the faults"
            if self.last_checkpoint.is_file()
            else "no checkpoint had been written yet"
        )
        return (
            f"training stopped at step {step}: non-finite {what} at {self.in_a_row} optimizer steps in a row "
            f"(max_nonfinite_steps={self.limit}); {kept}. Lower optim.lr_scale, raise optim.warmup, set "
            "trainer.gradient_clip_val, or train in bf16-mixed or 32-true instead of 16-mixed"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "overflows": self.overflows, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped, self.overflows, self.in_a_row = state["skipped"], state["overflows"], state["in_a_row"]


class Preempted(Exception):
    """The run saved its last checkpoint after a signal and stopped; the same command continues it."""

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        super().__init__(
            f"{name} received: stopped after step {step} and saved {checkpoint}; run the same command again "
            "(or add resume=true) to continue from there"
        )


class Preemption(Checkpoint):
    """On SIGTERM or SIGUSR1 (a scheduler's notice before it stops or requeues a job) the run finishes
    its current optimizer step, writes ``path`` (``last.ckpt``, from which a restarted run continues
    with the next batch) and stops with :class:`Preempted`.

    The checkpoint is written at the end of the step; the run stops once Lightning has logged the
    step's metrics, when the next batch or a validation would start (or training ends). As a
    :class:`~pytorch_lightning.callbacks.Checkpoint` it runs after the other callbacks, whose state
    (token counts, random generators) then includes the step. The handlers replace Lightning's (which
    would stop without a checkpoint, possibly in the middle of a gradient accumulation) while training
    runs, and are restored after it. A signal that reaches one DDP rank stops all of them at one step.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.received: int | None = None
        self.stop: Preempted | None = None
        self._previous: dict[int, Any] = {}
        self._step: int | None = None

    def _notice(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        log.warning("%s received: saving a checkpoint after this optimizer step", signal.Signals(signum).name)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step = trainer.global_step
        if threading.current_thread() is threading.main_thread():  # Python handles signals there only
            for signum in PREEMPTION_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._notice)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step or self.stop is not None:
            return  # in the middle of a gradient accumulation: its batches are not in any checkpoint
        self._step = trainer.global_step
        flag = torch.tensor([float(self.received is not None)], device=pl_module.device)
        if any_rank(trainer, flag)[0]:
            trainer.save_checkpoint(self.path)
            self.stop = Preempted(self.received or signal.SIGTERM, trainer.global_step, self.path)

    def _stop_if_saved(self) -> None:
        if self.stop is not None:
            raise self.stop

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._stop_if_saved()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_if_saved()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()
        self._stop_if_saved()  # the signal came at the last step: no testing now, the restarted run tests

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()
