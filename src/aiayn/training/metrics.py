"""What a run logs, by name, and its metrics CSV read back: for the tools that read runs without training
(the sweep runner, the report) as much as for the trainer, so nothing here imports Lightning."""

from __future__ import annotations

import csv
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from aiayn.errors import DataError
from aiayn.files import NotPlainFile, atomic_write, open_plain

log = logging.getLogger(__name__)

EVALUATION_METRICS = ("loss", "nll", "ppl", "bleu")  # logged as <stage>/<name> after each evaluation
# The checkpoint a run validates and tests after training (checkpoint.evaluate, results.json's "evaluated"):
# the best by its monitored metric, or the last step's.
EVALUATED_CHECKPOINTS = ("best", "final")
METRICS_CSV = Path("csv") / "metrics.csv"  # in a run folder: what the run's CSV logger writes
METRIC_ROW_BYTES = 1 << 20  # a metrics row is some kB: a longer line is damage, skipped without being held
_METRICS_FIX = "move it out of the run folder to continue the run without its earlier metric rows"


def metric_rows(path: Path) -> Iterator[dict[str, str]]:
    """The rows of the metrics CSV ``path`` (:data:`METRICS_CSV`), by column, that are rows of it: rows
    cut short by a kill, lines that are not UTF-8 CSV of the header's width, or too long to be a row, are
    left out. Nothing when there is no file; a :class:`DataError` naming the file when it is not a
    metrics CSV (a link, no ``step`` column)."""
    try:
        with open_plain(path) as file:
            lines = _lines(file)
            header = _metrics_header(path, next(lines, b""))
            for line in lines:
                fields = _fields(line)
                if fields is not None and len(fields) == len(header):
                    yield dict(zip(header, fields, strict=True))
    except FileNotFoundError:
        return
    except NotPlainFile as error:
        raise DataError(f"{path}: {error.why}; {_METRICS_FIX}") from None


def metric_columns(path: Path) -> list[str]:
    """The columns of the metrics CSV ``path``: none when there is no file or it is empty; a
    :class:`DataError` naming the file when it is not a metrics CSV."""
    try:
        with open_plain(path) as file:
            return _metrics_header(path, next(_lines(file), b""))
    except FileNotFoundError:
        return []
    except NotPlainFile as error:
        raise DataError(f"{path}: {error.why}; {_METRICS_FIX}") from None


def drop_metrics_from(path: Path, step: int) -> int:
    """Remove the rows of ``metrics.csv`` that a run resumed at optimizer step ``step`` logs again: those
    of Lightning's step ``step`` and later (a training row of optimizer step N carries step N - 1, a
    validation after step N too; the evaluations after training carry the final step). They were
    written after the checkpoint, by a part of the run that ended before its next one. Lines that are no
    rows of the file (cut short by a kill, damaged, not UTF-8 CSV) go too, with a warning unless the last
    was only cut short. Returns how many lines went. A file that is no metrics CSV is a :class:`DataError`."""
    try:
        source = open_plain(path)
    except FileNotFoundError:
        return 0
    except NotPlainFile as error:
        raise DataError(f"{path}: {error.why}; {_METRICS_FIX}") from None
    dropped = damaged = 0

    def write(out: IO[bytes]) -> None:
        nonlocal dropped, damaged
        out.write(first.rstrip(b"\r\n") + b"\n")
        column = header.index("step")
        for line in lines:
            fields = _fields(line)
            row_step = _row_step(fields, column) if fields is not None and len(fields) == len(header) else None
            if line is not None and row_step is not None and row_step < step:
                out.write(line.rstrip(b"\r\n") + b"\n")  # a kept row cut short ends its line: rows append after it
                continue
            dropped += 1
            if row_step is None and (line is None or line.endswith(b"\n")):  # more than the last row cut short
                damaged += 1

    with source:
        lines = _lines(source)
        if (first := next(lines, b"")) == b"":
            return 0  # an empty file: a part killed before it wrote the header
        header = _metrics_header(path, first)
        atomic_write(path, write)
    if damaged:
        log.warning("%s: dropped %d lines that are not rows of its columns (damaged, or not CSV)", path, damaged)
    return dropped


def _lines(file: IO[bytes]) -> Iterator[bytes | None]:
    """The lines of ``file``, with their ends; None for one longer than :data:`METRIC_ROW_BYTES`, which is
    skipped without being held (a file of one huge line would take its size in memory)."""
    while line := file.readline(METRIC_ROW_BYTES + 1):
        if len(line) > METRIC_ROW_BYTES:
            while not line.endswith(b"\n") and (line := file.readline(METRIC_ROW_BYTES)):
                pass
            yield None
        else:
            yield line


def _fields(line: bytes | None) -> list[str] | None:
    """A line's CSV fields, or None when it is not a line of UTF-8 CSV."""
    if line is None:
        return None
    try:
        return next(csv.reader([line.decode("utf-8").rstrip("\r\n")], strict=True), [])
    except (UnicodeDecodeError, csv.Error):  # csv.Error: a field over csv's limit, a quote left open
        return None


def _metrics_header(path: Path, line: bytes | None) -> list[str]:
    """The columns of a metrics CSV's first line (none for an empty file), or a :class:`DataError` naming
    the file when it is not the header Lightning writes, which always has a ``step`` column."""
    if line == b"":
        return []
    header = _fields(line)
    if header is None or "step" not in header:
        raise DataError(f"{path}: its first line is not the header of a metrics CSV (no 'step' column); {_METRICS_FIX}")
    return header


def _row_step(fields: list[str], column: int) -> int | None:
    """A row's step, None when it is not a whole number (a damaged row)."""
    try:
        value = float(fields[column])
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value.is_integer() else None
