"""The learning-rate schedule of eq. 3 (§5.3), often called "Noam"."""

from __future__ import annotations


class NoamSchedule:
    """``lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)`` (eq. 3).

    A callable object rather than a lambda, so that ``LambdaLR`` stores it in checkpoints. Used with
    a base learning rate of 1.0, its value is the learning rate itself. ``step`` counts optimizer
    steps from 1: ``LambdaLR`` passes 0 before the first update.
    """

    def __init__(self, d_model: int, warmup: int = 4000, scale: float = 1.0) -> None:
        if d_model <= 0 or warmup <= 0 or scale <= 0:
            raise ValueError(f"NoamSchedule needs positive d_model, warmup and scale, got {d_model}, {warmup}, {scale}")
        self.d_model, self.warmup, self.scale = d_model, warmup, scale

    def __call__(self, step: int) -> float:
        step = step + 1
        return self.scale * self.d_model**-0.5 * min(step**-0.5, step * self.warmup**-1.5)
