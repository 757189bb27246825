"""The checkpoints a run writes into ``<run>/checkpoints/``: ``last.ckpt`` (:class:`LastCheckpoint`, its
one owner), ``best.ckpt`` (the best validation score so far) and ``step<N>.ckpt`` (:class:`StepCheckpoints`,
the newest few, for averaging, §6.1). Every write and deletion goes through
:class:`~aiayn.training.checkpoint_io.RunCheckpointIO`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Checkpoint, ModelCheckpoint

from aiayn.training.checkpoints import STEP_NAME


class LastCheckpoint(Checkpoint):
    """The one writer of ``<folder>/last.ckpt``: the whole training state (weights, Adam's moments, the
    schedule, the loops' progress, the loader's position in the epoch, every callback's state), from
    which a run continues.

    Its life cycle, all of it here:

    1. **At every validation of a fit**, after the validation: the checkpoint holds that validation's
       results (and the best-checkpoint tracker's), so a run continued from it repeats no validation.
    2. **Inside the training loop, at the step the run stops**: ``max_steps`` reached, a callback's
       request to stop (the ``trainer.max_time`` timer), or a scheduler's signal
       (:class:`~aiayn.training.callbacks.preemption.Preemption` calls :meth:`save_in_loop`). Saved
       there, the loader's position and the progress counters are those of the middle of the epoch, so
       a continued run goes on with the next batch; a checkpoint saved after ``fit`` returns marks the
       epoch as finished instead.
    3. **After fit**, when the loop ended without (2) at its last step (an epoch limit):
       :meth:`after_fit`.

    Each write replaces the file atomically: a process killed while writing leaves the previous one.
    Nothing deletes it. The next process in the same folder (a restarted or requeued run) or
    ``resume=<path>`` reads it after :func:`~aiayn.training.checkpoints.check_resumable`;
    :class:`~aiayn.training.callbacks.faults.NonFiniteGuard` names it as the last good state when it
    stops a diverged run. As a :class:`~pytorch_lightning.callbacks.Checkpoint` it runs after the other
    callbacks (their state then includes the step, and it sees the timer's request to stop).
    """

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / "last.ckpt"
        self.loop_step: int | None = None  # the step of the last save from inside the training loop

    def save(self, trainer: pl.Trainer) -> None:
        """Write the whole training state now. Every DDP rank calls it (rank 0 writes)."""
        trainer.save_checkpoint(self.path, weights_only=False)

    def save_in_loop(self, trainer: pl.Trainer) -> None:
        """(2): write it from inside the training loop, once per step."""
        if self.loop_step != trainer.global_step:
            self.save(trainer)
            self.loop_step = trainer.global_step

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self.save(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if 0 < trainer.max_steps <= trainer.global_step or trainer.should_stop:
            self.save_in_loop(trainer)

    def after_fit(self, trainer: pl.Trainer) -> None:
        """(3): once ``fit`` has returned, write it unless the loop did at its last step."""
        if self.loop_step != trainer.global_step:
            self.save(trainer)


class FinalStepValidation(pl.Callback):
    """The step a ``max_steps`` run ends at is validated, so that it is a step checkpoint (and a candidate
    for ``best.ckpt``) even when it is not a multiple of ``checkpoint.every_steps``: the paper's base runs
    validate every 1400 steps up to 100000, and without this their newest step checkpoint, the last of the
    five averaged (§6.1), would be step 98000 + 1400 = 99400. Lightning validates after a batch that asks
    the trainer to stop, as it does for ``trainer.max_time``."""

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True


class StepCheckpoints(ModelCheckpoint):
    """``step<N>.ckpt``, the newest ``keep_last`` of them kept (Lightning's "top k" by step), for the
    average the run ends with (§6.1). Written at every validation; with ``average_every``, every that many
    optimizer steps instead, without validating: the average is then over finely spaced checkpoints of
    the run's last part, whatever validations cost.

    The step a run stops at is one too (the paper's last averaged checkpoint is its final step), except
    after an early stop (the ``trainer.max_time`` budget, a callback's request; not ``max_steps``) that
    comes less than half a spacing after the newest step checkpoint: the two would be near-duplicates in
    the average. That checkpoint is skipped, not swapped for the older one: the final weights are in
    ``last.ckpt`` anyway, and nothing already written is deleted. The spacing is ``average_every``, else
    the steps between the two newest step checkpoints (after the first one, its own step).

    Every rank decides alike, from the global step, ``trainer.should_stop`` (the timer broadcasts it)
    and the tracked files; Lightning writes on rank 0, atomically through the run's checkpoint IO. The
    tracked files are in every checkpoint, under the key of Lightning's validation tracker whatever
    ``average_every`` is: a resumed run keeps pruning its earlier part's files and, counting from the
    restored global step, continues the same spacing.
    """

    def __init__(self, folder: Path, keep_last: int, average_every: int | None = None, **options: Any) -> None:
        super().__init__(
            dirpath=folder, filename=STEP_NAME, monitor="step", mode="max", save_top_k=keep_last, **options
        )
        self.average_every = average_every
        self._step_seen: int | None = None  # the global step after the previous batch

    @property
    def state_key(self) -> str:
        """The key of the plain ``ModelCheckpoint`` that tracked step checkpoints before this class: the
        checkpoints of earlier runs, and of runs with another ``average_every``, restore this state."""
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._step_seen = trainer.global_step  # a resumed run's step is saved already

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.average_every is None:
            return
        finished = trainer.global_step != self._step_seen  # else: in the middle of a gradient accumulation
        self._step_seen = trainer.global_step
        on_grid = finished and trainer.global_step % self.average_every == 0
        if on_grid or (self._stops(trainer) and not self._near_duplicate(trainer)):
            self._save(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.average_every is None and not (self._stops(trainer) and self._near_duplicate(trainer)):
            super().on_validation_end(trainer, pl_module)

    def _stops(self, trainer: pl.Trainer) -> bool:
        return trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step

    def _near_duplicate(self, trainer: pl.Trainer) -> bool:
        """Whether the run stops early less than half a spacing after the newest step checkpoint."""
        tracked = sorted(int(step) for step in self.best_k_models.values())
        if not tracked or 0 < trainer.max_steps <= trainer.global_step:
            return False  # the first, or the planned end: always a step checkpoint
        spacing = self.average_every or tracked[-1] - [0, *tracked][-2]
        return trainer.global_step - tracked[-1] < spacing / 2

    def _save(self, trainer: pl.Trainer) -> None:
        """Lightning's own save of a top-k checkpoint (and deletion of the one it displaces), now."""
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))


def validation_checkpoints(
    folder: Path, monitor: str, mode: str, keep_last: int, average_every: int | None = None
) -> tuple[ModelCheckpoint, LastCheckpoint, StepCheckpoints]:
    """The checkpoints a fit writes: ``best.ckpt`` (``monitor`` at its ``mode``), :class:`LastCheckpoint`,
    and :class:`StepCheckpoints` (at validations, or every ``average_every`` steps); they run as best,
    steps, last (:class:`~aiayn.experiments.run.RunCallbacks`). None at the end of an epoch without a
    validation: a save there would mark the epoch done, not resumable in its middle; and a continued run
    rewrites its own files, never ``best-v1.ckpt``."""
    options: dict[str, Any] = {
        "auto_insert_metric_name": False,
        "enable_version_counter": False,
        "save_on_train_epoch_end": False,
    }
    best = ModelCheckpoint(dirpath=folder, filename="best", monitor=monitor, mode=mode, save_top_k=1, **options)
    return best, LastCheckpoint(folder), StepCheckpoints(folder, keep_last, average_every, **options)
