"""The errors a user can act on, each with a message that says what is wrong and what to do, and the
value checks that raise them. Plain Python: every layer may import this module, the model included.

Files that others may have made (a corpus, a shared folder's records) are read through
:func:`open_plain` and :func:`read_plain_file`, lines through :func:`bounded_lines`: only plain files,
and never more than a stated number of bytes at once; anything else is a :class:`DataError` naming it.
A parsed record's :func:`nesting` is bounded too.

The command-line tools report them in one line without a traceback (:mod:`aiayn.cli.common`):
:class:`ConfigError`, :class:`DataError`, :class:`CheckpointError` and :class:`RunFolderBusy` exit with
status 2 (fix the input and run again), :class:`TrainingDiverged` with status 1. :class:`FieldError` is what the
framework-free model layer raises about its own fields; the config layer turns it into the
:class:`ConfigError` that names the config key (:func:`aiayn.config.build.config_keys`).
"""

from __future__ import annotations

import errno
import functools
import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

# A line of a corpus or of a text to translate holds one sentence (or a document's segment): kilobytes.
LINE_BYTES = 1 << 20


class FieldError(ValueError):
    """A field of a plain object (:class:`~aiayn.model.TransformerConfig`, decoding options) with a value
    it cannot take: ``<field>=<value> <what is allowed>``."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}={show(value)} {allowed}")


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


def open_plain(path: Path, *, follow_links: bool = False) -> IO[bytes]:
    """``path`` open for reading when it is a plain file, else a :class:`DataError` naming it: a FIFO, a
    device or a socket (reading one could block, or never end), and a link unless ``follow_links`` (a
    link in a folder aiayn writes is never aiayn's, and may lead anywhere; a file the user names, such
    as a corpus, may be a link to a plain file). Nothing there is a :class:`FileNotFoundError`."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)  # O_NONBLOCK: opening a FIFO that nobody writes would wait forever
    except OSError as error:
        if error.errno in (errno.ENOENT, errno.ENOTDIR):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path)) from None
        if error.errno == errno.ELOOP and not follow_links:
            raise DataError(f"{path}: is a link, not a plain file") from None
        raise DataError(f"{path}: cannot be read ({error.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise DataError(f"{path}: is {_kind(mode)}, not a plain file")
    os.set_blocking(fd, True)  # a plain file: some network file systems would answer EAGAIN otherwise
    return os.fdopen(fd, "rb")


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a folder" if stat.S_ISDIR(mode) else "something else"


def read_plain_file(path: Path, limit: int, *, follow_links: bool = False) -> bytes:
    """The bytes of the plain file ``path`` (:func:`open_plain`), when it has at most ``limit`` of them; a
    larger file is a :class:`DataError` naming it, found having read ``limit`` + 1 bytes at most."""
    with open_plain(path, follow_links=follow_links) as file:
        size = os.fstat(file.fileno()).st_size
        if size > limit:
            raise _too_large(path, limit)
        content = file.read(size + 1)  # sized by the file, not the limit: a read's buffer is as large as asked
        if len(content) > size:  # grown since, or of a size the system does not know (/proc): read on
            content += file.read(limit + 1 - len(content))
    if len(content) > limit:
        raise _too_large(path, limit)
    return content


def _too_large(path: Path, limit: int) -> DataError:
    return DataError(f"{path}: more than the {limit} bytes such a file has")


def bounded_lines(stream: IO[bytes], name: str, limit: int = LINE_BYTES) -> Iterator[bytes]:
    """The lines of ``stream`` without their line feeds, each read only while it has at most ``limit``
    bytes: a longer one is a :class:`DataError` (``<name>:<line>``) once ``limit`` + 1 of its bytes are
    read, so that a runaway line (a file of no line feeds, inflated from a small ``.gz``) never fills
    the memory."""
    for number, line in enumerate(iter(functools.partial(stream.readline, limit + 1), b""), start=1):
        if line.endswith(b"\n"):
            yield line[:-1]
        elif len(line) > limit:
            raise DataError(f"{name}:{number}: a line of more than {limit} bytes; a line holds one sentence")
        else:
            yield line  # the last, without a line feed


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
