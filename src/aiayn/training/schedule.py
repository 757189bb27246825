"""How a run optimises: Adam's settings (§5.3), label smoothing (§5.4), the learning-rate schedule (eq. 3,
often called "Noam", by default; fairseq's inverse square root, linear, cosine and warmup-stable-decay
beyond the paper) and decoupled weight decay (AdamW, beyond the paper).

Every schedule is a callable object that ``LambdaLR`` calls with the optimizer steps done so far and
that returns the learning rate itself (the optimizer's base learning rate is 1.0). ``LambdaLR`` saves
the object's attributes in checkpoints, so they are plain numbers and words. The decaying schedules
(:data:`DECAYING`) end at ``min_lr`` when the run ends, whether ``trainer.max_steps`` or
``trainer.max_time`` ends it: where the decay begins and ends is fixed in steps when its phase begins
(:meth:`WarmupDecaySchedule.place_decay`); under a time limit its end is projected again every
:data:`REPROJECT_EVERY` steps from the rate the decay phase has trained at. Both are stored with the
schedule, so that a resumed run continues the same curve."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from aiayn.errors import FieldError, is_number, show, whole

SCHEDULES = ("noam", "inverse_sqrt", "linear", "cosine", "wsd")
DECAYING = ("linear", "cosine", "wsd")  # down to min_lr at the end of the run's budget
# Under trainer.max_time, the steps between projections of the decay's end: a projection made once, at the
# end of warmup, counts the run's start-up and missed the end by 10% of the run (benchmarks/RESULTS.md); one
# every 50 steps misses it by a few steps at most, for one broadcast under DDP.
REPROJECT_EVERY = 50


@dataclass(frozen=True)
class OptimSettings:
    """Label smoothing (§5.4), Adam's ``betas`` and ``eps`` and eq. 3's ``warmup`` steps and ``lr_scale``
    (§5.3); the paper's by default. ``schedule`` picks the learning rate's course (:func:`lr_schedule`);
    the schedules other than ``noam`` rise to ``lr`` and the decaying ones fall to ``min_lr``, ``wsd``
    over the last ``decay_fraction`` of the run. ``weight_decay`` > 0 trains with AdamW's decoupled
    decay (:func:`parameter_groups`). A value none of them can use raises
    :class:`~aiayn.errors.FieldError` naming the field, when the settings are made."""

    label_smoothing: float = 0.1
    betas: Sequence[float] = (0.9, 0.98)
    eps: float = 1e-9
    warmup: int = 4000
    lr_scale: float = 1.0
    schedule: str = "noam"
    lr: float | None = None
    min_lr: float = 0.0
    decay_fraction: float = 0.2
    weight_decay: float = 0.0

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
        self._check_schedule()
        if not is_number(self.weight_decay) or self.weight_decay < 0:
            allowed = "must be a number >= 0 (0: Adam, as the paper; > 0: AdamW's decoupled weight decay)"
            raise FieldError("weight_decay", self.weight_decay, allowed)
        object.__setattr__(self, "betas", tuple(betas))

    def _check_schedule(self) -> None:
        """The schedule's own settings: ``lr``, ``lr_scale`` or ``min_lr`` that the chosen schedule would
        ignore is refused, so that a run never trains with a learning rate other than the one its config
        seems to ask for (``decay_fraction``, which has a default, is wsd's alone)."""
        if self.schedule not in SCHEDULES:
            raise FieldError("schedule", self.schedule, f"must be one of {', '.join(SCHEDULES)} (noam: eq. 3)")
        if self.schedule == "noam":
            if self.lr is not None:
                allowed = f"must be null for schedule=noam, whose peak is eq. 3's (lr_scale={self.lr_scale} scales it)"
                raise FieldError("lr", self.lr, allowed)
        elif self.lr is None:
            allowed = f"must be set for schedule={self.schedule}: the peak learning rate, reached after warmup"
            raise FieldError("lr", self.lr, allowed)
        elif not is_number(self.lr) or self.lr <= 0:
            raise FieldError("lr", self.lr, "must be a number > 0 (the peak learning rate)")
        elif self.lr_scale != 1.0:
            allowed = f"scales eq. 3 only; schedule={self.schedule} peaks at lr={self.lr} (set that instead)"
            raise FieldError("lr_scale", self.lr_scale, allowed)
        if not is_number(self.min_lr) or self.min_lr < 0 or (self.lr is not None and self.min_lr > self.lr):
            allowed = f"must be a number from 0 to lr={show(self.lr)}: the floor the decay ends at"
            raise FieldError("min_lr", self.min_lr, allowed)
        if self.min_lr != 0 and self.schedule not in DECAYING:
            allowed = f"is the floor of the schedules {', '.join(DECAYING)}; schedule={self.schedule} has none (use 0)"
            raise FieldError("min_lr", self.min_lr, allowed)
        if not is_number(self.decay_fraction) or not 0 < self.decay_fraction <= 1:
            raise FieldError("decay_fraction", self.decay_fraction, "must lie in (0, 1] (wsd's share of the run)")

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


@dataclass(frozen=True)
class Budget:
    """Where a run stands against its limits: ``max_steps`` optimizer steps (None: no step limit) and,
    under ``trainer.max_time``, ``elapsed`` of ``seconds`` (Lightning's ``Timer``, which stops the run
    and restores its clock from checkpoints). None of ``seconds``: no time limit."""

    max_steps: int | None
    elapsed: float = 0.0
    seconds: float | None = None

    def progress(self, done: int) -> float:
        """How far the run is after ``done`` steps: the further along of steps and time, 1.0 at the end."""
        by_steps = done / self.max_steps if self.max_steps else 0.0
        by_time = self.elapsed / self.seconds if self.seconds else 0.0
        return max(by_steps, by_time)

    def end(self, done: int, since: tuple[int, float] | None = None) -> int | None:
        """The step the run ends at, seen after ``done`` steps: ``max_steps``, or the step the time runs
        out at if the run keeps its rate, whichever comes first; None when nothing limits it. The rate is
        the one since ``since`` (steps done, seconds elapsed), where given and past, else the run's so
        far (its start-up included)."""
        ends = [self.max_steps] if self.max_steps else []
        if self.seconds and self.elapsed > 0:
            steps, seconds = since if since and done > since[0] and self.elapsed > since[1] else (0, 0.0)
            rate = (done - steps) / (self.elapsed - seconds)
            ends.append(done + math.floor(rate * max(0.0, self.seconds - self.elapsed)))
        return max(min(ends), done + 1) if ends else None


class WarmupDecaySchedule:
    """A linear warmup from 0 to ``lr`` over ``warmup`` steps, then, by ``kind``:

    - ``inverse_sqrt``: ``lr * sqrt(warmup / step)``, fairseq's ``inverse_sqrt`` (eq. 3's shape, with a
      peak of one's choice: ``lr = d_model^-0.5 * warmup^-0.5`` is eq. 3);
    - ``linear``, ``cosine``: from ``lr`` straight down, or along half a cosine, to ``min_lr``, between
      the end of warmup and the end of the run;
    - ``wsd`` (warmup, stable, decay): ``lr`` until the last ``decay_fraction`` of the run, then straight
      down to ``min_lr``. Linear, the simplest decay that ends at the floor; a cooldown of 20% makes
      up for most of the gap to cosine (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training
      Beyond Fixed Training Durations").

    ``step`` counts optimizer steps from 1, as in :class:`NoamSchedule`: ``LambdaLR`` passes the steps
    done. The decay runs from step ``decay_start`` (the last at the peak) to step ``decay_end`` (the
    first at ``min_lr``, which stays: a run that ends there makes its last update at the floor); None
    until :meth:`place_decay` fixes them, and stored in checkpoints with the settings. A time-bound
    run moves ``decay_end`` as it learns its speed (:meth:`reproject`): the decay then goes on from
    where it stood at step ``anchor_step`` (``anchor_progress`` of the way down) to the new end, so
    the learning rate never jumps; ``decay_start_seconds``, the time trained when the decay began,
    gives the rate the projection uses.
    """

    def __init__(self, kind: str, lr: float, warmup: int, min_lr: float = 0.0, decay_fraction: float = 0.2) -> None:
        if kind not in SCHEDULES[1:] or lr <= 0 or warmup <= 0 or not 0 <= min_lr <= lr or not 0 < decay_fraction <= 1:
            raise ValueError(
                f"WarmupDecaySchedule needs a kind of {SCHEDULES[1:]}, lr > 0, warmup > 0, 0 <= min_lr <= lr and "
                f"decay_fraction in (0, 1], got {kind}, {lr}, {warmup}, {min_lr}, {decay_fraction}"
            )
        self.kind, self.lr, self.warmup, self.min_lr, self.decay_fraction = kind, lr, warmup, min_lr, decay_fraction
        self.decay_start: int | None = None
        self.decay_end: int | None = None
        self.decay_start_seconds: float | None = None
        self.anchor_step: int | None = None
        self.anchor_progress = 0.0

    def __call__(self, step: int) -> float:
        step = step + 1
        if step <= self.warmup:
            return self.lr * step / self.warmup
        if self.kind == "inverse_sqrt":
            return self.lr * math.sqrt(self.warmup / step)
        done = self.decayed(step)
        left = 0.5 * (1 + math.cos(math.pi * done)) if self.kind == "cosine" else 1 - done
        return self.min_lr + (self.lr - self.min_lr) * left

    def decayed(self, step: int) -> float:
        """How far down the decay is at optimizer step ``step`` (from 1): 0 at the peak, 1 at the floor.
        Linear in the steps from the anchor (the decay's start, or its latest :meth:`reproject`) on."""
        if self.decay_start is None or self.decay_end is None or step <= self.decay_start:
            return 0.0
        anchor = self.decay_start if self.anchor_step is None else self.anchor_step
        left = 1.0 - self.anchor_progress
        return min(1.0, self.anchor_progress + left * (step - anchor) / (self.decay_end - anchor))

    def decay_due(self, done: int, budget: Budget) -> bool:
        """Whether the decay phase has begun after ``done`` steps and is not placed yet: right after
        warmup (linear, cosine), or once the run is ``1 - decay_fraction`` of the way (wsd, by steps or
        by time, whichever is further along). A run that nothing limits never decays."""
        if self.kind not in DECAYING or self.decay_start is not None or done < self.warmup or budget.end(done) is None:
            return False
        return self.kind != "wsd" or budget.progress(done) >= 1 - self.decay_fraction

    def place_decay(self, done: int, end: int, seconds: float | None = None) -> None:
        """Fix the decay in steps: from ``done`` (the steps done when its phase began, after ``seconds``
        of training under a time limit) to ``end`` (:meth:`Budget.end`, after ``done``). From then on the
        learning rate is a function of the step alone, until a :meth:`reproject`."""
        self.decay_start, self.decay_end, self.decay_start_seconds = done, end, seconds
        self.anchor_step, self.anchor_progress = done, 0.0

    def reproject_due(self, done: int, budget: Callable[[], Budget]) -> bool:
        """Whether to project the decay's end again after ``done`` steps: every :data:`REPROJECT_EVERY`
        steps of a placed decay under a time limit, until the floor is reached (a step limit is exact).
        ``budget`` gives the run's limits; it is asked only on those steps, not on every step."""
        placed = self.decay_start is not None and self.decay_end is not None and done > self.decay_start
        if not placed or done % REPROJECT_EVERY != 0 or self.decayed(done) >= 1.0:
            return False
        return budget().seconds is not None

    def reproject(self, done: int, end: int) -> None:
        """Move the decay's end to ``end`` (after ``done``), going on from where the decay stands after
        ``done`` steps."""
        self.anchor_progress, self.anchor_step, self.decay_end = self.decayed(done), done, max(end, done + 1)

    def rate_since(self) -> tuple[int, float] | None:
        """The steps and seconds at the decay's start under a time limit: the projections use the rate
        since then, which leaves out the run's start-up."""
        if self.decay_start is None or self.decay_start_seconds is None:
            return None
        return self.decay_start, self.decay_start_seconds

    def continue_from(self, stored: Mapping[str, Any]) -> None:
        """Keep the decay that the run a checkpoint holds (``stored``, its schedule's saved attributes)
        had placed, when it had this kind of schedule: the settings are this run's, the position the
        checkpoint's. A run that changes the kind places its decay anew."""
        if stored.get("kind") == self.kind and stored.get("decay_start") is not None:
            self.decay_start, self.decay_end = stored["decay_start"], stored["decay_end"]
            self.decay_start_seconds = stored.get("decay_start_seconds")
            self.anchor_step, self.anchor_progress = stored.get("anchor_step"), stored.get("anchor_progress", 0.0)


Schedule = NoamSchedule | WarmupDecaySchedule
# What LambdaLR saves of any of them (their attributes): the only fields a checkpoint's schedule may hold.
SCHEDULE_FIELDS = frozenset(vars(NoamSchedule(1))) | frozenset(vars(WarmupDecaySchedule("wsd", 1.0, 1)))


def lr_schedule(optim: OptimSettings, d_model: int) -> Schedule:
    """The learning rate by step that ``optim`` asks for; ``d_model`` sets eq. 3's scale (§5.3)."""
    if optim.schedule == "noam":
        return NoamSchedule(d_model, optim.warmup, optim.lr_scale)
    assert optim.lr is not None  # OptimSettings requires it for every schedule but noam
    return WarmupDecaySchedule(optim.schedule, optim.lr, optim.warmup, optim.min_lr, optim.decay_fraction)


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The parameters of ``model`` as AdamW's two groups: the weights of its linear maps decayed by
    ``weight_decay``; biases, LayerNorm gains and embeddings (and so an output projection tied to
    them, §3.4) not, as usual since BERT: they set scales and offsets that decay would only pull
    towards zero. Both groups in the order of ``model.parameters()``, which checkpoints rely on."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)} - embeddings
    parameters = list(model.parameters())
    return [
        {"params": [p for p in parameters if id(p) in linear], "weight_decay": weight_decay},
        {"params": [p for p in parameters if id(p) not in linear], "weight_decay": 0.0},
    ]
