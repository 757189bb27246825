"""The effective batch: target tokens per optimizer step, whatever the number of devices (§5.1).

The paper trains on batches of about 25000 source and 25000 target tokens, spread over 8 GPUs. With
``tokens_per_step`` set, each optimizer step accumulates the gradients of enough per-device
batches (``data.max_tokens`` tokens each, padding included) on all ranks to reach it, so one, two or
eight devices train with the same batch, the same schedule and the same number of steps. A setting
that cannot come within 10% of it (too many devices for the per-device budget) is an error.
"""

from __future__ import annotations

import logging
from typing import Any

import pytorch_lightning as pl

from aiayn.errors import ConfigError, whole

log = logging.getLogger(__name__)
TOLERANCE = 0.1  # how far the tokens per optimizer step may fall from tokens_per_step


def accumulation_steps(tokens_per_step: int, max_tokens: int, world_size: int) -> int:
    """Per-device batches to accumulate so that ``world_size`` devices with ``max_tokens`` each make
    about ``tokens_per_step`` tokens per optimizer step (the nearest whole number, at least one); an
    error when that is more than :data:`TOLERANCE` away."""
    if not whole(tokens_per_step, 1):  # data.max_tokens is the data module's to check
        raise ConfigError("tokens_per_step", tokens_per_step, "must be a positive whole number of tokens")
    steps = max(1, round(tokens_per_step / (max_tokens * world_size)))
    reached = steps * max_tokens * world_size
    if abs(reached - tokens_per_step) > TOLERANCE * tokens_per_step:
        fitting = round(tokens_per_step / (steps * world_size))
        raise ConfigError(
            "tokens_per_step",
            tokens_per_step,
            f"is out of reach with data.max_tokens={max_tokens} on {world_size} device(s) "
            f"({steps} x {max_tokens} x {world_size} = {reached}); set data.max_tokens={fitting}",
        )
    return steps


def configure_batching(
    trainer: pl.Trainer, tokens_per_step: int | None, max_tokens: int, every_steps: int | None
) -> dict[str, Any]:
    """Set the trainer's gradient accumulation from ``tokens_per_step`` and its validation interval
    from ``every_steps`` (optimizer steps, which Lightning counts in batches); return what was chosen."""
    world = trainer.world_size
    if tokens_per_step is not None:
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError(
                "trainer.accumulate_grad_batches",
                trainer.accumulate_grad_batches,
                f"conflicts with tokens_per_step={tokens_per_step}, which sets the gradient accumulation; "
                "remove one of them",
            )
        trainer.accumulate_grad_batches = accumulation_steps(tokens_per_step, max_tokens, world)
    accumulation = trainer.accumulate_grad_batches
    if every_steps is not None:
        if not isinstance(every_steps, int) or every_steps < 1:
            allowed = "must be a positive number of optimizer steps (or null)"
            raise ConfigError("checkpoint.every_steps", every_steps, allowed)
        trainer.val_check_interval = every_steps * accumulation
        trainer.check_val_every_n_epoch = None  # the interval may span epochs
    batching = {
        "world_size": world,
        "max_tokens_per_device": max_tokens,
        "accumulation": accumulation,
        "max_tokens_per_step": max_tokens * world * accumulation,
        "tokens_per_step": tokens_per_step,
    }
    log.info(
        "batches: %d device(s) x %d tokens x %d accumulated = at most %d tokens per optimizer step%s",
        world,
        max_tokens,
        accumulation,
        batching["max_tokens_per_step"],
        f" (tokens_per_step={tokens_per_step})" if tokens_per_step else "",
    )
    return batching


def batch_layout(trainer: pl.Trainer) -> dict[str, int]:
    """What the sampler's position in an epoch depends on beyond the data: the processes that share each
    batch and the batches accumulated per optimizer step (stored in checkpoints; a resume compares them)."""
    return {"world_size": trainer.world_size, "accumulation": trainer.accumulate_grad_batches}
