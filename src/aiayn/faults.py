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

from aiayn.callbacks import distributed, metrics_flushed_at
from aiayn.errors import TrainingDiverged

log = logging.getLogger(__name__)
PREEMPTION_SIGNALS = (signal.SIGTERM,)  # a scheduler stopping the job (SLURM's preemption, its time limit)
REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)  # advance notices: sbatch --signal=USR1@120, submitit's USR2
MIN_LOSS_SCALE = 1e-4  # fp16: a scaler this low means gradients overflow at any scale (fairseq's floor too)


def max_over_ranks(trainer: pl.Trainer, values: torch.Tensor) -> list[float]:
    """Each of ``values`` (a float tensor on the module's device) at its largest over the DDP ranks; this
    rank's own in a single process. Every rank calls it at the same point: it is a collective under DDP."""
    if distributed() and trainer.world_size > 1:
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    return values.tolist()


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
        flags = torch.stack([loss_bad.to(norm.device), ~torch.isfinite(norm)]).float()
        loss_bad, grad_bad = map(bool, max_over_ranks(trainer, flags))  # losses differ by rank, gradients not
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
    """On SIGTERM, SIGUSR1 or SIGUSR2 (a scheduler's notice before it stops or requeues a job) the run
    finishes its current optimizer step, writes ``path`` (``last.ckpt``, from which a restarted run
    continues with the next batch) and stops with :class:`Preempted`.

    A signal that comes during a validation is acted on at its end, where the validation's own
    ``last.ckpt`` is the checkpoint; a step due for validation validates before the run stops, so the
    restarted run repeats nothing and leaves nothing out. The run stops once Lightning has logged the
    step's metrics, when the next batch would start (or training ends).

    SIGUSR1 and SIGUSR2 then go on to the handlers they had before training (Lightning's SLURM requeue,
    submitit's checkpoint-and-requeue); SIGTERM's (Lightning's would stop without a checkpoint) does
    not run. As a :class:`~pytorch_lightning.callbacks.Checkpoint` this callback runs after the others,
    whose state (token counts, random generators) then includes the step. A signal that reaches one DDP
    rank stops all of them at the same step.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.received = 0  # the signal's number; set by the handler, which does nothing else
        self.stop: Preempted | None = None
        self._previous: dict[int, Any] = {}
        self._step: int | None = None

    def _notice(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step = trainer.global_step
        if threading.current_thread() is threading.main_thread():  # Python handles signals there only
            for signum in (*PREEMPTION_SIGNALS, *REQUEUE_SIGNALS):
                self._previous[signum] = signal.signal(signum, self._notice)

    def _agreed_signal(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        """The signal any rank received (every rank calls this at the same point), or 0."""
        (signum,) = max_over_ranks(trainer, torch.tensor([float(self.received)], device=pl_module.device))
        return int(signum)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step or self.stop is not None:
            return  # in the middle of a gradient accumulation: its batches are not in any checkpoint
        self._step = trainer.global_step
        signum = self._agreed_signal(trainer, pl_module)
        if signum:
            trainer.save_checkpoint(self.path, weights_only=False)
            self._stopped(signum, trainer.global_step)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit" or self.stop is not None:
            return
        signum = self._agreed_signal(trainer, pl_module)
        if signum:  # the validation's own checkpoints, last.ckpt among them, were just written
            self._stopped(signum, trainer.global_step)

    def _stopped(self, signum: int, step: int) -> None:
        log.warning("%s received: saved %s after step %d", signal.Signals(signum).name, self.path, step)
        self.stop = Preempted(signum, step, self.path)
        previous = self._previous.get(signum)
        if signum in REQUEUE_SIGNALS and callable(previous):
            previous(signum, None)  # may requeue the job and exit

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self.stop is not None:
            raise self.stop

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()
        if self.stop is not None:
            raise self.stop  # the signal came at the last step: the restarted run evaluates

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()
