"""The effective batch: target tokens per optimizer step, whatever the number of devices (§5.1).

The paper trains on batches of about 25000 source and 25000 target tokens, spread over 8 GPUs. With
``tokens_per_step`` set, each optimizer step accumulates the gradients of enough per-device batches on all
ranks to reach it, so one, two or eight devices train with the same batch, the same schedule and the same
number of steps. A device's batch (its micro-batch, padding included) is either

- ``data.max_tokens`` tokens, accumulated as often as it takes: a setting that cannot come within 10% of
  ``tokens_per_step`` (too many devices for the per-device budget) is an error; or
- with ``data.max_tokens: null``, the device's share, ``tokens_per_step / world size``, as one micro-batch:
  one optimizer step is one forward and backward per device, which pays the host's per-step work once
  instead of once per accumulated batch. Where that share does not fit the device's memory,
  ``micro_batch_cap`` caps it: the share is split into the fewest equal micro-batches within the cap,
  accumulated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl

from aiayn.errors import FieldError, whole

log = logging.getLogger(__name__)
TOLERANCE = 0.1  # how far the tokens per optimizer step may fall from tokens_per_step


@dataclass(frozen=True)
class BatchSettings:
    """How a run forms its batches: ``tokens_per_step`` (None: the Trainer's accumulation as given),
    ``max_tokens`` (a device's micro-batch; None: its share of ``tokens_per_step``), ``cap`` (the most
    tokens a micro-batch may hold; None: no cap), and ``max_len`` (the longest sentence a micro-batch must
    hold). Checked when made, before any work; the errors (:class:`~aiayn.errors.FieldError`) name these
    fields, and :func:`plan_batches`'s also ``accumulate``, the Trainer's accumulation as given."""

    tokens_per_step: int | None = None
    max_tokens: int | None = None
    cap: int | None = None
    max_len: int = 1

    def __post_init__(self) -> None:
        if self.tokens_per_step is not None and not whole(self.tokens_per_step, 1):
            raise FieldError("tokens_per_step", self.tokens_per_step, "must be a positive whole number of tokens")
        if self.max_tokens is None and self.tokens_per_step is None:
            raise FieldError(
                "max_tokens", None, "takes each device's share of {tokens_per_step}: set {tokens_per_step} too"
            )
        if self.cap is None:
            return
        if not whole(self.cap, 1):
            raise FieldError("cap", self.cap, "must be a whole number of tokens >= 1, or null (no cap)")
        if whole(self.max_len, 1) and self.cap < self.max_len:  # max_len is the data module's to check
            raise FieldError(
                "cap",
                self.cap,
                f"is smaller than the longest sentence training keeps ({{max_len}}={self.max_len} tokens); "
                "raise {cap} or lower {max_len}",
            )
        if whole(self.max_tokens, 1) and self.max_tokens > self.cap:
            raise FieldError(
                "max_tokens",
                self.max_tokens,
                f"is over {{cap}}={self.cap}; lower it, or set {{max_tokens}}=null to split each "
                "device's share of {tokens_per_step} within the cap",
            )


def accumulation_steps(tokens_per_step: int, max_tokens: int, world_size: int) -> int:
    """Per-device batches to accumulate so that ``world_size`` devices with ``max_tokens`` each make
    about ``tokens_per_step`` tokens per optimizer step (the nearest whole number, at least one); an
    error when that is more than :data:`TOLERANCE` away."""
    if not whole(tokens_per_step, 1):  # max_tokens is the data module's to check
        raise FieldError("tokens_per_step", tokens_per_step, "must be a positive whole number of tokens")
    steps = max(1, round(tokens_per_step / (max_tokens * world_size)))
    reached = steps * max_tokens * world_size
    if abs(reached - tokens_per_step) > TOLERANCE * tokens_per_step:
        fitting = round(tokens_per_step / (steps * world_size))
        raise FieldError(
            "tokens_per_step",
            tokens_per_step,
            f"is out of reach with {{max_tokens}}={max_tokens} on {world_size} device(s) "
            f"({steps} x {max_tokens} x {world_size} = {reached}); set {{max_tokens}}={fitting}",
        )
    return steps


def micro_batches(tokens_per_step: int, world_size: int, cap: int | None = None, max_len: int = 1) -> tuple[int, int]:
    """``(tokens per micro-batch, micro-batches accumulated)`` when each of ``world_size`` devices takes its
    share of ``tokens_per_step``: the whole share at once, or, over ``cap``, the fewest equal parts within
    it; an error when a part could not hold a sentence of ``max_len`` tokens."""
    share = tokens_per_step // world_size
    steps = 1 if cap is None else max(1, -(-share // cap))
    tokens = share // steps
    if tokens < max_len:
        field, value = ("cap", cap) if steps > 1 else ("tokens_per_step", tokens_per_step)
        raise FieldError(
            field,
            value,
            f"leaves micro-batches of {tokens} tokens ({tokens_per_step} tokens per step on {world_size} device(s)), "
            f"fewer than the longest sentence training keeps ({{max_len}}={max_len}); raise {{{field}}} or lower "
            "{max_len}",
        )
    return tokens, steps


def plan_batches(batch: BatchSettings, world: int, accumulate: int) -> dict[str, Any]:
    """The batches of a run on ``world`` processes, planned before its Trainer exists: the tokens of a
    device's micro-batch (``max_tokens_per_device``, the data module's budget), the micro-batches each
    optimizer step accumulates (``accumulation``: ``accumulate``, ``trainer.accumulate_grad_batches``,
    unless ``batch.tokens_per_step`` sets it), and how they were chosen (``formed``). The record goes into
    results.json; :func:`trainer_arguments` turns it into the Trainer's."""
    tokens_per_step = batch.tokens_per_step
    if tokens_per_step is not None and accumulate != 1:
        raise FieldError(
            "accumulate",
            accumulate,
            f"conflicts with {{tokens_per_step}}={tokens_per_step}, which sets the gradient accumulation; "
            "remove one of them",
        )
    max_tokens, formed, accumulation = batch.max_tokens, "data.max_tokens", accumulate
    if max_tokens is None:
        assert tokens_per_step is not None  # checked when made
        max_tokens, accumulation = micro_batches(tokens_per_step, world, batch.cap, batch.max_len)
        formed = "tokens_per_step / world_size" + (f" within micro_batch_cap={batch.cap}" if batch.cap else "")
    elif tokens_per_step is not None:
        accumulation = accumulation_steps(tokens_per_step, max_tokens, world)
    batching = {
        "world_size": world,
        "max_tokens_per_device": max_tokens,
        "accumulation": accumulation,
        "max_tokens_per_step": max_tokens * world * accumulation,
        "tokens_per_step": tokens_per_step,
        "formed": formed,
    }
    log.info(
        "batches: %d device(s) x %d tokens x %d accumulated = at most %d tokens per optimizer step (micro-batch: %s%s)",
        world,
        max_tokens,
        accumulation,
        batching["max_tokens_per_step"],
        formed,
        f"; tokens_per_step={tokens_per_step}" if tokens_per_step else "",
    )
    return batching


def trainer_arguments(batching: dict[str, Any], every_steps: int | None) -> dict[str, Any]:
    """The Trainer's arguments the planned batches set: the accumulation, and with ``every_steps`` (optimizer
    steps, which Lightning counts in batches) the validation interval, which may then span epochs."""
    arguments: dict[str, Any] = {"accumulate_grad_batches": batching["accumulation"]}
    if every_steps is not None:
        arguments |= {"val_check_interval": every_steps * batching["accumulation"], "check_val_every_n_epoch": None}
    return arguments


def batch_layout(trainer: pl.Trainer) -> dict[str, int]:
    """What the sampler's position in an epoch depends on beyond the data: the processes that share each
    batch and the batches accumulated per optimizer step (stored in checkpoints; a resume compares them)."""
    return {"world_size": trainer.world_size, "accumulation": trainer.accumulate_grad_batches}
