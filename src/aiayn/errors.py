"""The errors a user can act on, each with a message that says what is wrong and what to do.

The command-line tools report them in one line without a traceback (:mod:`aiayn.cli.common`):
:class:`ConfigError`, :class:`DataError` and :class:`CheckpointError` exit with status 2 (fix the
input and run again), :class:`TrainingDiverged` with status 1.
"""

from __future__ import annotations

import math
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig


class ConfigError(ValueError):
    """A setting that is impossible or does not fit the others, found before any work starts."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={show(value)} {allowed}")


class DataError(RuntimeError):
    """Input data that cannot be used as it is; the message names the file (and line)."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or does not fit the others or the run."""


class TrainingDiverged(RuntimeError):
    """The loss or the gradients stayed non-finite: training stopped, the last good checkpoint is kept."""


def whole(value: Any, minimum: int) -> bool:
    """``value`` is an int (not a bool, which YAML's ``true`` would be) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def show(value: Any) -> str:
    """A config value as a user would type it on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and (value == "" or value != value.strip()):
        return repr(value)
    return str(value)


def instantiated(spec: DictConfig, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate``, but a target's own :class:`ConfigError` or
    :class:`DataError` (a one-line message naming the key and the fix) is raised as it is,
    not wrapped into Hydra's exception with its traceback."""
    try:
        return instantiate(spec, **kwargs)
    except InstantiationException as error:
        if isinstance(error.__cause__, ConfigError | DataError):
            raise error.__cause__ from None
        raise
