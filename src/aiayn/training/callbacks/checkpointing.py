"""The checkpoints a run writes into ``<run>/checkpoints/``: ``last.ckpt`` (:class:`LastCheckpoint`, its
one owner), ``best.ckpt`` (the best validation score so far) and ``step<N>.ckpt`` (:class:`StepCheckpoints`,
the newest few, for averaging, §6.1; weights-only snapshots written off the step path with
``checkpoint.average_every``). Every write and deletion goes through
:class:`~aiayn.training.checkpoint_io.RunCheckpointIO`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from weakref import proxy

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Checkpoint, ModelCheckpoint

from aiayn.training.callbacks.ema import EVALUATION_KEYS
from aiayn.training.callbacks.run_state import SelfContainedCheckpoints
from aiayn.training.checkpoints import STEP_NAME
from aiayn.training.snapshots import SnapshotWriter

log = logging.getLogger(__name__)


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
    average the run ends with (§6.1). Written at every validation, as the whole training state; with
    ``average_every``, every that many optimizer steps instead, without validating, as weights-only
    snapshots (the model's weights, the run's config and tokenizer; no optimizer, loops or callbacks, as
    ``ema.ckpt``): the average is then over finely spaced checkpoints of the run's last part, whatever
    validations cost, and the step pays only for a copy of the weights
    (:class:`~aiayn.training.snapshots.SnapshotWriter` writes them, and deletes the displaced ones, on a
    thread of its own). The whole training state is ``last.ckpt``'s, at validations and when the run
    stops (:class:`LastCheckpoint`).

    The step a run stops at is one too (the paper's last averaged checkpoint is its final step), except
    after an early stop (the ``trainer.max_time`` budget, a callback's request; not ``max_steps``) that
    comes less than half a spacing after the newest step checkpoint: the two would be near-duplicates in
    the average. That checkpoint is skipped, not swapped for the older one: the final weights are in
    ``last.ckpt`` anyway, and nothing already written is deleted. The spacing is ``average_every``, else
    the steps between the two newest step checkpoints (after the first one, its own step).

    Every rank decides alike, from the global step, ``trainer.should_stop`` (the timer broadcasts it)
    and the tracked files, without a vote; rank 0 writes, atomically through the run's checkpoint IO. The
    tracked files are in every checkpoint, under the key of Lightning's validation tracker whatever
    ``average_every`` is: a resumed run keeps pruning its earlier part's files and, counting from the
    restored global step, continues the same spacing. The snapshots still being written are on disk before
    any checkpoint names them (:meth:`state_dict` waits for them), before the training ends, and when it
    fails; a write's error ends the run on the training thread.
    """

    def __init__(self, folder: Path, keep_last: int, average_every: int | None = None, **options: Any) -> None:
        super().__init__(
            dirpath=folder, filename=STEP_NAME, monitor="step", mode="max", save_top_k=keep_last, **options
        )
        self.average_every = average_every
        self._step_seen: int | None = None  # the global step after the previous batch
        self._writer: SnapshotWriter | None = None  # rank 0's, with average_every
        self._entries: dict[str, Any] | None = None  # a snapshot's entries besides its weights, per fit
        self._notified = 0  # snapshots written that the loggers were told of

    @property
    def state_key(self) -> str:
        """The key of the plain ``ModelCheckpoint`` that tracked step checkpoints before this class: the
        checkpoints of earlier runs, and of runs with another ``average_every``, restore this state."""
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def state_dict(self) -> dict[str, Any]:
        self._flush()  # a checkpoint names only files that are on disk
        return super().state_dict()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._step_seen = trainer.global_step  # a resumed run's step is saved already
        self._entries = None
        if self.average_every is not None and trainer.is_global_zero:
            self._writer = self._writer or SnapshotWriter(trainer.strategy.checkpoint_io)
            self._writer.reserve(trainer.strategy.lightning_module_state_dict())

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.average_every is None:
            return
        self._written(trainer)
        finished = trainer.global_step != self._step_seen  # else: in the middle of a gradient accumulation
        self._step_seen = trainer.global_step
        on_grid = finished and trainer.global_step % self.average_every == 0
        if on_grid or (self._stops(trainer) and not self._near_duplicate(trainer)):
            self._save(trainer)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._writer is not None:
            self._writer.hold_weights()  # the step must not change weights the snapshot still copies

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.average_every is None and not (self._stops(trainer) and self._near_duplicate(trainer)):
            super().on_validation_end(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._flush()
        self._written(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        try:
            self._close()
        except Exception as error:  # the run's own exception goes on; this one must not go unseen
            log.error("a step checkpoint could not be written: %s", error, exc_info=error)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self._close()

    def check_monitor_top_k(self, trainer: pl.Trainer, current: torch.Tensor | None = None) -> bool:
        """Lightning's decision without its vote of the ranks (an all-reduce that waits for the device's
        queue): a newer step is the better one on every rank alike."""
        if current is None or self.save_top_k == 0:
            return False
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        return bool(current > self.best_k_models[self.kth_best_model_path])

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

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if self.average_every is None:
            super()._save_checkpoint(trainer, filepath)
            return
        if trainer.is_global_zero:
            if self._entries is None:
                self._entries = snapshot_entries(trainer)
            entries = {**self._entries, "epoch": trainer.current_epoch, "global_step": trainer.global_step}
            assert self._writer is not None  # made at the start of training
            self._writer.save(Path(filepath), entries, trainer.strategy.lightning_module_state_dict())
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath

    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if self._writer is None:
            super()._remove_checkpoint(trainer, filepath)
        elif trainer.is_global_zero:
            self._writer.remove(Path(filepath))  # once the snapshot that displaced it is written

    def _written(self, trainer: pl.Trainer) -> None:
        """Tell the loggers of snapshots written since they were last told (Lightning tells them of each
        checkpoint it saves; a logger that uploads checkpoints then finds the file), and raise the
        writer's error, if any."""
        if self._writer is None:
            return
        self._writer.check()
        if self._writer.written != self._notified:
            self._notified = self._writer.written
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def snapshot_entries(trainer: pl.Trainer) -> dict[str, Any]:
    """What a weights-only snapshot holds besides its weights, its step and its epoch: the entries of an
    evaluation checkpoint (:data:`~aiayn.training.callbacks.ema.EVALUATION_KEYS`: the Lightning version, the
    hyperparameters, the run's config and tokenizer), as Lightning and
    :class:`~aiayn.training.callbacks.run_state.SelfContainedCheckpoints` write them into every checkpoint."""
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=True)
    for callback in trainer.callbacks:
        if isinstance(callback, SelfContainedCheckpoints):
            callback.on_save_checkpoint(trainer, trainer.lightning_module, checkpoint)
    return {key: checkpoint[key] for key in EVALUATION_KEYS if key in checkpoint}


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
