"""The signals a scheduler sends before it stops or requeues a job: the run saves where it is and stops,
so that the same command continues it. All DDP ranks decide alike (an all-reduce of the signal's
number at each optimizer step, on the CPU: it never waits for a GPU), so every rank saves and stops at
the same step.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Checkpoint

from aiayn.training.callbacks.checkpointing import LastCheckpoint
from aiayn.training.distributed import host_group, max_over_ranks

log = logging.getLogger(__name__)
# A scheduler stopping the job (SLURM's preemption, its time limit), and Ctrl-C at a terminal.
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)  # advance notices: sbatch --signal=USR1@120, submitit's USR2


class Preempted(Exception):
    """The run saved its last checkpoint after a signal and stopped; the command-line tool says how to
    continue it (:func:`aiayn.cli.common.continue_advice`)."""

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        super().__init__(f"{name} received: stopped after step {step} and saved {checkpoint};")


class Preemption(Checkpoint):
    """On SIGTERM, SIGUSR1 or SIGUSR2 (a scheduler's notice before it stops or requeues a job) and on
    SIGINT (Ctrl-C; a second one stops at once, without saving) the run finishes its current optimizer
    step, has ``last`` write ``last.ckpt`` (from which a restarted run continues with the next batch)
    and stops with :class:`Preempted`.

    A signal that comes during a validation is acted on at its end, where the validation's own
    ``last.ckpt`` is the checkpoint; a step due for validation validates before the run stops, so the
    restarted run repeats nothing and leaves nothing out. The run stops once Lightning has logged the
    step's metrics, when the next batch would start (or training ends).

    A scheduler's signal marks the W&B run preempting (under ``wandb agent``, W&B's sweep then requeues
    the trial into the same run and folder). SIGUSR1 and SIGUSR2 then go on to the handlers they had
    before training (Lightning's SLURM requeue, submitit's checkpoint-and-requeue); SIGTERM's and
    SIGINT's (Lightning's would stop without a checkpoint) do not run. As a
    :class:`~pytorch_lightning.callbacks.Checkpoint` this callback runs after the others, whose state
    (token counts, random generators) then includes the step. A signal that reaches one DDP rank stops
    all of them at the same step.
    """

    def __init__(self, last: LastCheckpoint) -> None:
        self.last = last
        self.received = 0  # the signal's number; set by the handler, which does nothing else
        self.stop: Preempted | None = None
        self._previous: dict[int, Any] = {}
        self._step: int | None = None
        self._group: Any = None  # where the ranks exchange the signal: distributed.host_group

    def _notice(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without waiting for the step to end
        self.received = signum

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step = trainer.global_step
        self._group = host_group()
        if threading.current_thread() is threading.main_thread():  # Python handles signals there only
            for signum in (*PREEMPTION_SIGNALS, *REQUEUE_SIGNALS):
                self._previous[signum] = signal.signal(signum, self._notice)

    def _agreed_signal(self) -> int:
        """The signal any rank received (every rank calls this at the same point), or 0."""
        (signum,) = max_over_ranks([self.received], "cpu", self._group)
        return int(signum)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step or self.stop is not None:
            return  # in the middle of a gradient accumulation: its batches are not in any checkpoint
        self._step = trainer.global_step
        signum = self._agreed_signal()
        if signum:
            self.last.save_in_loop(trainer)
            self._stopped(signum, trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit" or self.stop is not None:
            return
        signum = self._agreed_signal()
        if signum:  # the validation's own checkpoints, last.ckpt among them, were just written
            self._stopped(signum, trainer)

    def _stopped(self, signum: int, trainer: pl.Trainer) -> None:
        step = trainer.global_step
        log.warning("%s received: saved %s after step %d", signal.Signals(signum).name, self.last.path, step)
        self.stop = Preempted(signum, step, self.last.path)
        if signum != signal.SIGINT:  # a scheduler's, not Ctrl-C: the dashboard's run is preempted, not crashed
            for logger in trainer.loggers:
                if callable(mark := getattr(logger, "mark_preempting", None)):
                    mark()
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
