"""What a run frees, returned at known points between steps: Python's garbage (collections, none in the
middle of a step) and the free pages of the C heap after decoding.

Python collects when allocations outnumber deallocations by a threshold, wherever that happens: inside a
step, a full collection walks every tracked object (hundreds of thousands once torch, Lightning and the
run are set up) while the GPU waits for work. As torchtitan (``training.gc_freq``) and Megatron-LM
(``--manual-gc``) do, the objects that live as long as the fit (model, optimizer, loaders, imports) are
frozen once set up (:func:`gc.freeze`: no collection walks them again), automatic collection is off while
training, and the young generations are collected every ``every`` optimizer steps, after the step; a full
collection, of the unfrozen objects only, follows each validation of the fit, where decoding leaves most
garbage and the host waits anyway. The collector's state before the fit (enabled, nothing frozen) is
restored when it ends, also when it fails: the next fit in the process (tests, sweeps) starts as it would
have without this one.
"""

from __future__ import annotations

import gc
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.trainer.states import TrainerFn

from aiayn.errors import FieldError, whole
from aiayn.machine import release_freed_memory, retaining_freed_memory, return_freed_memory


class ScheduledCollection(pl.Callback):
    """Freezes the objects set up for the fit and collects garbage every ``every`` optimizer steps (the
    youngest two generations) and after each of its validations (all unfrozen objects), never in between
    (see the module's docstring)."""

    def __init__(self, every: int) -> None:
        if not whole(every, 1):
            allowed = "must be a whole number of optimizer steps >= 1, or null (Python collects by itself)"
            raise FieldError("every", every, allowed)
        self.every = every
        self._before: tuple[bool, bool] | None = None  # (automatic collection was on, nothing was frozen)
        self._collected_at = 0  # the optimizer step after which the latest scheduled collection ran

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._before = (gc.isenabled(), gc.get_freeze_count() == 0)
        self._collected_at = trainer.global_step
        gc.collect()  # the set-up's garbage goes before the survivors are frozen
        gc.freeze()
        gc.disable()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step  # moves at optimizer steps only, not at accumulated micro-batches
        if step != self._collected_at and step % self.every == 0:
            self._collected_at = step
            gc.collect(generation=1)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._before is not None and trainer.state.fn == TrainerFn.FITTING:
            gc.collect()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()  # after every other callback's end of training

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        """The collector as it was before the fit."""
        if self._before is None:
            return
        enabled, unfrozen = self._before
        self._before = None
        if unfrozen:  # objects somebody else froze stay frozen
            gc.unfreeze()
        if enabled:
            gc.enable()


class FreedMemoryRelease(pl.Callback):
    """Gives the heap's free pages back to the kernel after every validation and test
    (:func:`~aiayn.machine.release_freed_memory`): the decoding's freed blocks would otherwise stay in the
    process's resident memory, and a run's memory would grow with its validations. When training ends,
    also its heap's, and a process that retained freed memory for the training steps returns it again
    for the decoding that follows (:func:`~aiayn.machine.return_freed_memory`; aiayn-train retains it anew
    for each run)."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if retaining_freed_memory():
            return_freed_memory()
        release_freed_memory()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        release_freed_memory()

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        release_freed_memory()
