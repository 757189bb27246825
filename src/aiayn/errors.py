"""The errors a user can act on, each with a message that says what is wrong and what to do, and the
value checks that raise them. Plain Python: every layer may import this module, the model included.

A parsed record's :func:`nesting` is bounded before anything walks it by recursion.

The command-line tools report them in one line without a traceback (:mod:`aiayn.cli.common`):
:class:`ConfigError`, :class:`DataError`, :class:`CheckpointError` and :class:`RunFolderBusy` exit with
status 2 (fix the input and run again), :class:`TrainingDiverged` with status 1. :class:`FieldError` is what the
framework-free model layer raises about its own fields; the config layer turns it into the
:class:`ConfigError` that names the config key (:func:`aiayn.config.build.config_keys`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

_FIELD_REFERENCE = re.compile(r"\{([a-z_]+)\}")  # "{max_tokens}": a field a FieldError's message names
_FIELD_SETTING = re.compile(r"(?<![\w.])([a-z_]+)=")  # ... or with its value: "positional=sinusoidal"


class FieldError(ValueError):
    """A field of a plain object (:class:`~aiayn.model.TransformerConfig`, decoding options, a layer's
    settings) with a value it cannot take: ``<field>=<value> <what is allowed>``. ``allowed`` names the
    object's other fields as ``{name}``: shown as ``name`` here, and as its config key where the config
    layer names the error (:func:`aiayn.config.build.config_keys`)."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}={show(value)} {_FIELD_REFERENCE.sub(lambda match: match.group(1), allowed)}")

    def named(self, key: Callable[[str], str]) -> tuple[str, str]:
        """This field and the message's others (``{field}``, or ``field=`` as in ``must be even for
        positional=sinusoidal``) each as ``key(field)``: the key, and what is allowed."""
        allowed = _FIELD_SETTING.sub(lambda match: key(match.group(1)) + "=", self.allowed)
        return key(self.field), _FIELD_REFERENCE.sub(lambda match: key(match.group(1)), allowed)


class ConfigError(ValueError):
    """A setting that is impossible or does not fit the others, found before any work starts."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={show(value)} {allowed}")


class DataError(RuntimeError):
    """Input data that cannot be used as it is; the message names the file (and line)."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or does not fit the others or the run."""


class RunFolderBusy(RuntimeError):
    """A run folder that another living process is writing (its lock, :mod:`aiayn.files`, is held)."""

    def __init__(self, folder: Any, holder: str) -> None:
        self.folder, self.holder = folder, holder
        super().__init__(
            f"run folder {folder} is in use by {holder}: one process writes a run folder; wait for it to end, "
            "stop it, or start this run in another folder"
        )


class TrainingDiverged(RuntimeError):
    """The loss or the gradients stayed non-finite: training stopped, the last good checkpoint is kept."""


def whole(value: Any, minimum: int) -> bool:
    """``value`` is an int (not a bool, which YAML's ``true`` would be) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float (10**400): not a number a setting can use
        return False


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (a library's can have several), or its type's name when it
    has none: how a one-line message quotes the error it stems from."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def show(value: Any) -> str:
    """A config value as a user would type it on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and (value == "" or value != value.strip()):
        return repr(value)
    return str(value)


def nesting(value: Any) -> int:
    """How deeply ``value`` nests lists and mappings (a number or text: 0), found without recursion: a
    parsed record nested deeper than its writer nests it is refused before Python compares, prints or
    validates it by recursion (a RecursionError, not a message)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            pending.extend((inner, level + 1) for inner in (item.values() if isinstance(item, dict) else item))
    return deepest
