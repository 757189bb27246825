"""Which checkpoints a run keeps, evaluates, averages and answers with: :class:`CheckpointPolicy`, checked
where it is made (each mistake a :class:`~aiayn.errors.FieldError` of its field)."""

from __future__ import annotations

from dataclasses import dataclass

from aiayn.errors import FieldError, whole
from aiayn.training.metrics import EVALUATED_CHECKPOINTS, EVALUATION_METRICS

# The answer to give (results.json names the one given): a tested checkpoint, or by_validation: of those
# tested, the one with the best validation BLEU (the test split is read to report, never to choose).
ANSWER_SETTINGS = ("evaluated", "averaged", "ema", "by_validation")


@dataclass(frozen=True)
class CheckpointPolicy:
    """The checkpoints kept (the best by ``monitor`` in ``mode``, the newest ``keep_last`` step
    checkpoints), the one evaluated after training (``best`` or ``final``), the newest ``average_last``
    averaged for a second test (§6.1), a validation every ``every_steps`` optimizer steps (None: as the
    trainer's validation interval says), the step checkpoints every ``average_every`` optimizer steps
    instead of at validations (None), and which of the tested checkpoints is the run's ``answer``. A
    ``monitor`` every validation logs (else the run would fail at its first validation, after the work), a
    ``mode`` saying which way it improves, an ``evaluate`` naming a checkpoint, and counts that fit together."""

    monitor: str
    mode: str
    keep_last: int
    average_last: int
    evaluate: str
    every_steps: int | None
    average_every: int | None
    answer: str = "evaluated"  # the tested checkpoint results.json reports as the run's answer

    def __post_init__(self) -> None:
        monitored = [f"val/{name}" for name in EVALUATION_METRICS]
        if self.monitor not in monitored:
            raise FieldError("monitor", self.monitor, f"is not a validation metric; use one of {', '.join(monitored)}")
        if self.evaluate not in EVALUATED_CHECKPOINTS:
            raise FieldError("evaluate", self.evaluate, "must be best (by {monitor}) or final (the last step)")
        if self.answer not in ANSWER_SETTINGS:
            allowed = (
                "must be evaluated ({evaluate}'s), averaged ({average_last}'s), ema ({decay}'s) or by_validation "
                "(of those tested, the best by validation BLEU)"
            )
            raise FieldError("answer", self.answer, allowed)
        if self.mode not in ("min", "max"):
            raise FieldError("mode", self.mode, "must be max (val/bleu) or min (val/loss, val/nll, val/ppl)")
        keep, average = self.keep_last, self.average_last
        if not whole(keep, 0):
            raise FieldError("keep_last", keep, "must be a whole number >= 0 (0 keeps no step checkpoints)")
        if not whole(average, 0):
            raise FieldError("average_last", average, "must be a whole number >= 0 (0 or 1: no averaging)")
        if self.answer == "averaged" and average < 2:
            allowed = f"needs checkpoints to average: set {{average_last}}>=2 (it is {average})"
            raise FieldError("answer", "averaged", allowed)
        if average > max(keep, 1):
            raise FieldError("average_last", average, f"needs that many kept checkpoints; set {{keep_last}}>={average}")
        if self.average_every is not None and not whole(self.average_every, 1):
            allowed = "must be a whole number of optimizer steps >= 1, or null (step checkpoints at validations)"
            raise FieldError("average_every", self.average_every, allowed)
        if self.every_steps is not None and not whole(self.every_steps, 1):
            raise FieldError("every_steps", self.every_steps, "must be a positive number of optimizer steps (or null)")
