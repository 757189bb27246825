"""How a run optimises: Adam's settings and the learning-rate schedule of eq. 3 (§5.3), often called
"Noam", and label smoothing (§5.4)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from aiayn.errors import FieldError, is_number, whole


@dataclass(frozen=True)
class OptimSettings:
    """Label smoothing (§5.4), Adam's ``betas`` and ``eps`` and eq. 3's ``warmup`` steps and ``lr_scale``
    (§5.3); the paper's by default. A value none of them can use raises
    :class:`~aiayn.errors.FieldError` naming the field, when the settings are made."""

    label_smoothing: float = 0.1
    betas: Sequence[float] = (0.9, 0.98)
    eps: float = 1e-9
    warmup: int = 4000
    lr_scale: float = 1.0

    def __post_init__(self) -> None:
        if not is_number(self.label_smoothing) or not 0.0 <= self.label_smoothing < 1.0:
            raise FieldError("label_smoothing", self.label_smoothing, "must lie in [0, 1) (the paper uses 0.1)")
        betas = self.betas
        if (
            not isinstance(betas, Sequence)
            or isinstance(betas, str)
            or len(betas) != 2
            or not all(is_number(b) and 0.0 <= b < 1.0 for b in betas)
        ):
            shown = list(betas) if isinstance(betas, Sequence) and not isinstance(betas, str) else betas
            raise FieldError("betas", shown, "must be two numbers in [0, 1) (the paper uses [0.9, 0.98])")
        if not is_number(self.eps) or self.eps <= 0:
            raise FieldError("eps", self.eps, "must be a number > 0 (the paper uses 1e-9)")
        if not whole(self.warmup, 1):
            raise FieldError("warmup", self.warmup, "must be a whole number of steps >= 1 (the paper uses 4000)")
        if not is_number(self.lr_scale) or self.lr_scale <= 0:
            raise FieldError("lr_scale", self.lr_scale, "must be a number > 0 (1.0: eq. 3 as written)")
        object.__setattr__(self, "betas", tuple(betas))

    def to_dict(self) -> dict[str, Any]:
        """Plain data, as a checkpoint's hyperparameters hold them (``betas`` a list, as YAML writes it)."""
        return {**asdict(self), "betas": list(self.betas)}


PAPER_OPTIM = OptimSettings()  # §5.3, §5.4: label smoothing 0.1, Adam (0.9, 0.98, 1e-9), 4000 warmup steps


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
