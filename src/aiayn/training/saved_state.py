"""The checks of a saved state's fields, for what a checkpoint restores (:mod:`aiayn.training.restored_state`)
and for the callbacks that check their own saved state (:class:`CheckedState`): each failure is one line
naming the file and the field (:class:`~aiayn.errors.CheckpointError`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import pytorch_lightning as pl
import torch

from aiayn.errors import CheckpointError, is_number, whole

COUNT_LIMIT = 2**53  # counters (steps, batches, tokens) beyond this are not a run's: floats lose them


class Fields:
    """The checks of one checkpoint's fields; each failure is one line naming the file and the field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def error(self, field: str, value: Any, allowed: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {self.path}: {field}={short(value)} {allowed}; it is not a checkpoint aiayn-train "
            "writes, so it is not resumed"
        )

    def mapping(self, field: str, value: Any, keys: tuple[str, ...] | None = None) -> dict[Any, Any]:
        """``value``, a dict; with ``keys``, exactly those."""
        if not isinstance(value, dict):
            raise self.error(field, type(value).__name__, "is not a mapping")
        if keys is not None and set(value) != set(keys):
            odd = sorted(map(str, set(value) ^ set(keys)))[0]
            raise self.error(
                f"{field}.{odd}",
                "present" if odd in map(str, value) else "missing",
                "differs from what aiayn writes there",
            )
        return value

    def sequence(self, field: str, value: Any, length: int | None = None) -> list[Any] | tuple[Any, ...]:
        if not isinstance(value, list | tuple):
            raise self.error(field, type(value).__name__, "is not a list")
        if length is not None and len(value) != length:
            raise self.error(field, f"{len(value)} entries", f"is not this run's {length}")
        return value

    def count(self, field: str, value: Any) -> int:
        if not whole(value, 0) or value >= COUNT_LIMIT:
            raise self.error(field, value, f"is not a whole number in [0, {COUNT_LIMIT})")
        return value

    def number(self, field: str, value: Any, minimum: float | None = None) -> float:
        if not is_number(value) or (minimum is not None and value < minimum):
            raise self.error(field, value, "is not a finite number" + (f" >= {minimum}" if minimum is not None else ""))
        return value

    def shares(self, field: str, value: Any, world: int) -> list[Any] | tuple[Any, ...]:
        """The per-rank list of a state saved by :func:`~aiayn.training.distributed.gathered_from_ranks`."""
        shares = self.sequence(f"{field}.ranks", self.mapping(field, value, keys=("ranks",))["ranks"])
        if not 1 <= len(shares) <= max(world, 1024):
            raise self.error(f"{field}.ranks", f"{len(shares)} entries", "is not one per training process")
        return shares


@runtime_checkable
class CheckedState(Protocol):
    """A callback that checks the state it saved before it is restored: ``state`` as a checkpoint holds it,
    under ``name``; the state to load (or None to start afresh), or ``fields``' error."""

    def checked_state(
        self, state: Any, fields: Fields, name: str, trainer: pl.Trainer, module: pl.LightningModule
    ) -> Any: ...


def shape_of(value: Any) -> Any:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def short(value: Any) -> str:
    """A value as one short line, whatever it holds."""
    text = repr(value) if not isinstance(value, str) else value
    text = text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= 80 else text[:77] + "..."
