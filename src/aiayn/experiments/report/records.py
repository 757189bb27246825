"""A run's or sweep's records read as untrusted data: only plain files of a bounded size, never through a
link; JSON and alias-free YAML holding only what JSON holds; every field checked (type and range) by the
predicates here, a field that fails named in one line (:class:`DataError`)."""

from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePath
from typing import Any

import yaml

from aiayn.errors import DataError, whole
from aiayn.files import read_plain_file

# A run's records are kilobytes, test translations grow with the test split (a sweep's state with its
# trials: :data:`~aiayn.experiments.sweeps.state.STATE_BYTES`): larger files are not a run's, and are not
# read into memory.
RECORD_BYTES, HYPOTHESES_BYTES = 1 << 20, 256 << 20
# A name in a record (a language, a precision, a positional encoding, a cache entry): no space, no
# separator a path or a markdown table would read, no control character.
NAME = re.compile(r"[\w.+-]{1,200}")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_shown = reprlib.Repr()
_shown.maxstring = _shown.maxother = 60
_shown.maxlong, _shown.maxlevel, _shown.maxlist, _shown.maxdict = 24, 2, 4, 4


def shown(value: Any) -> str:
    """A value of a record as one short line, whatever its size or nesting."""
    return _shown.repr(value)


def brief(value: Any) -> str:
    """A stored value in a label or a line of the report: text as it is (cut short, on one line), anything
    else as :func:`shown`."""
    return CONTROL.sub(" ", value[:100]) if isinstance(value, str) else shown(value)


def malformed(path: Path, key: str, value: Any, allowed: str) -> DataError:
    return DataError(f"{path}: {key}={shown(value)} {allowed}; it is not as aiayn-train writes it")


def plain_file(path: Path, limit: int) -> bytes:
    """The bytes of ``path``, a plain file of at most ``limit`` bytes (:func:`~aiayn.files.read_plain_file`):
    a link (it may lead anywhere), a pipe or device (reading may never end), a larger file and a file in a
    linked folder (``.hydra`` a link to another folder) are refused with :class:`DataError`."""
    if path.parent.is_symlink():
        raise DataError(f"{path}: {path.parent} is a link; a run's files are read only in its own folder")
    try:
        return read_plain_file(path, limit)
    except OSError as error:
        raise DataError(f"{path}: cannot be read ({error.strerror})") from None


class _PlainYaml(yaml.SafeLoader):
    """YAML without aliases: OmegaConf and Hydra write none, and an alias can make a file of a few bytes
    a value of gigabytes once it is copied out."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError(f"an alias (*{self.peek_event().anchor})")
        return super().compose_node(parent, index)


def read_record(path: Path, limit: int = RECORD_BYTES) -> dict[str, Any]:
    """A ``.json`` or ``.yaml`` record of a run or sweep: a mapping, or :class:`DataError` in one line."""
    content = plain_file(path, limit)
    try:
        text = content.decode("utf-8")
        record = json.loads(text) if path.suffix == ".json" else yaml.load(text, Loader=_PlainYaml)
    except (ValueError, yaml.YAMLError, RecursionError) as error:
        first = " ".join(str(error).split())[:200] or type(error).__name__
        raise DataError(f"{path}: cannot be parsed ({first})") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}: holds {shown(record)}, not a mapping of fields")
    try:
        odd = next(not_plain(record, ""), None)
    except RecursionError:
        odd = ("", "nested too deeply")
    if odd is not None:
        raise DataError(f"{path}: {odd[0] or 'the file'} {odd[1]}; it is not as aiayn-train writes it")
    return record


def not_plain(value: Any, key: str) -> Iterator[tuple[str, str]]:
    """Where ``value`` holds more than JSON does (YAML dates, binary, sets, keys that are not text), which
    neither aiayn nor Hydra writes and which would trip code that compares or prints records."""
    if isinstance(value, dict):
        for name, item in value.items():
            if not isinstance(name, str):
                yield key, f"has the key {shown(name)}, not text"
            yield from not_plain(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from not_plain(item, f"{key}[{index}]")
    elif value is not None and not isinstance(value, str | int | float | bool):
        yield key, f"holds a {type(value).__name__}, not a plain value"


MISSING = object()


def at(record: Mapping[str, Any], key: str, path: Path) -> Any:
    """``record``'s value at the dotted ``key``, or MISSING; a level that is not a mapping is malformed."""
    value: Any = record
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(value, Mapping):
            raise malformed(path, ".".join(parts[:depth]), value, "must be a mapping")
        if part not in value:
            return MISSING
        value = value[part]
    return value


def field_of(
    record: Mapping[str, Any], key: str, path: Path, valid: Callable[[Any], bool], allowed: str, default: Any = MISSING
) -> Any:
    """``record``'s checked ``key``: a missing one is ``default`` (required when there is none)."""
    value = at(record, key, path)
    if value is MISSING:
        if default is MISSING:
            raise DataError(f"{path}: no {key}; it is not as aiayn-train writes it")
        return default
    if not valid(value):
        raise malformed(path, key, value, allowed)
    return value


def whole_in(low: int, high: int) -> Callable[[Any], bool]:
    return lambda value: whole(value, low) and value <= high


def number_in(low: float, high: float, diverged: bool = False) -> Callable[[Any], bool]:
    """A finite number (not a bool) from ``low`` to ``high``; with ``diverged``, also +inf and NaN (a
    diverged run's perplexity, which the report leaves out)."""

    def valid(value: Any) -> bool:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return False
        if isinstance(value, float) and (math.isnan(value) or value == math.inf):
            return diverged
        return low <= value <= high

    return valid


def optional(valid: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or valid(value)


def is_name(value: Any) -> bool:
    return isinstance(value, str) and NAME.fullmatch(value) is not None


def is_spec(value: Any) -> bool:
    """A component spec as config.yaml stores it: ``{_target_: a.Class, <argument>: <name or number>}``."""
    return (
        isinstance(value, dict)
        and len(value) <= 32
        and is_name(value.get("_target_"))
        and all(
            is_name(key) and (v is None or isinstance(v, bool) or is_name(v) or number_in(-1e12, 1e12)(v))
            for key, v in value.items()
        )
    )


def is_text(value: Any, longest: int = 1000) -> bool:
    return isinstance(value, str) and len(value) <= longest and CONTROL.search(value) is None


def is_overrides(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= 1000 and all(is_text(o) and o.strip() for o in value)


def inside_folder(value: Any) -> bool:
    """A relative path that stays below the folder it is relative to: no ``..``, no root, no home, no
    protocol (``local://``, ``s3://``)."""
    if not isinstance(value, str) or not value or "://" in value or value.startswith("~"):
        return False
    parts = PurePath(value).parts
    return not PurePath(value).is_absolute() and ".." not in parts and bool(parts)
