"""When Lightning hands the step metrics to the loggers. The callbacks that measure per step log only
then: :mod:`.throughput` over exactly the batches since the last flush, :mod:`.faults` the gradient norm
of a step whose metrics are written, not computed for steps whose values would be dropped."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytorch_lightning as pl


def metrics_flushed_at(trainer: pl.Trainer, step: int) -> bool:
    """Whether Lightning sends the step metrics to the loggers once the optimizer has made ``step``
    steps: at multiples of ``trainer.log_every_n_steps``, never in the middle of an accumulation."""
    n = trainer.log_every_n_steps
    return n > 0 and step % n == 0
