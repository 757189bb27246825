"""A checkpoint's bounds, checked before ``torch.load`` reads any of it: a shared file must not exhaust the
machine before :func:`~aiayn.training.checkpoints.load_checkpoint` can check what it holds.

``torch.save`` writes a zip archive of stored (not compressed) records: ``<archive>/data.pkl``, a pickle of
protocol 2, and one record ``<archive>/data/<key>`` per tensor storage. ``torch.load`` inflates compressed
records, reads every record it is told to (overlapping ones again and again), and unpickles ``data.pkl``
with references to earlier objects (the memo) that nest containers in containers, a few bytes for a tree
of any size, which every later walk of the checkpoint (its checks, its config) unfolds. So before that:

* the archive's directory is read here, at most :data:`MAX_RECORDS` entries: no record is compressed, none
  reaches past the file, none is named twice, the records' sizes add up to at most the file's, and the
  records of torch's own bookkeeping (``version``, ``byteorder``) are a few bytes;
* ``data.pkl`` is at most :func:`~aiayn.training.checkpoint_pickle.pickle_limit` bytes, a base and so
  much per tensor storage (the model's own size: aiayn's pickle holds each tensor's name and rebuild
  call, and once the config, the tokenizer and the loops' state);
* its opcodes are walked once, in linear time, before anything is read
  (:class:`~aiayn.training.checkpoint_pickle.PickleWalk`).

The check holds the pickle (at most 20 MiB, with :data:`MAX_RECORDS` storages) and about 80 bytes per
opcode: for the largest pickle the limits admit (655,000 opcodes) under 1 s and 51 MiB, measured on 2 CPU
cores; the hostile files of ``tests/training/test_checkpoint_limits.py`` are refused within 2 s and 64 MiB.
A file that is not a zip archive is refused too: aiayn never writes torch's legacy pickle format.
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from aiayn.errors import CheckpointError
from aiayn.training.checkpoint_pickle import Budget, PickleWalk, pickle_limit, refused, unreadable

# The storages of the weights, Adam's three states of each and the EMA: about 1,000 for the big model,
# 1,400 for Table 3's eight layers.
MAX_RECORDS = 4096
METADATA_BYTES = 1024  # a record of torch's bookkeeping (version, byteorder, serialization id): a few bytes
DIRECTORY_ENTRY_BYTES = 1024  # a directory entry: 46 bytes, the record's name (the file's stem) and zip64 sizes
_END = struct.Struct("<4s4H2LH")  # signature, disks, entries here and in all, directory size and offset, comment
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # signature, disk, offset of the zip64 end record, disks
_ZIP64_END = struct.Struct("<4sQ2H2L4Q")  # signature, size, versions, disks, entries, directory size and offset
_ENTRY = struct.Struct("<4s6H3L5H2L")  # a directory entry: method at 4, sizes at 8 and 9, lengths at 10-12, offset 16
_LOCAL = struct.Struct("<4s5H3L2H")  # a record's local header: its name's and extra field's lengths last
_ZIP64_EXTRA = 1
_FULL32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Record:
    """A zip archive's record as its directory states it."""

    name: str
    method: int  # 0: stored
    stored: int  # bytes in the file
    size: int  # bytes it holds
    offset: int  # of its local header


def check_checkpoint_limits(path: Path) -> None:
    """Refuse, with a one-line :class:`CheckpointError`, a file at ``path`` over the limits of this module,
    reading its directory and its pickle only (never a tensor's record)."""
    try:
        with Path(path).open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            records = archive_records(handle, size, path)
            storages, pickled = pickle_record(records, size, path)
            data = record_bytes(handle, pickled, size, path)
    except OSError as error:
        raise unreadable(path, error.strerror or str(error)) from None
    PickleWalk(data, Budget(storages, len(data)), path).run()


def archive_records(handle: BinaryIO, size: int, path: Path) -> list[Record]:
    """The records of the zip archive ``handle`` (``size`` bytes), from its directory, which must lie
    where ``torch.save`` writes it: just before the end records, at the file's end."""
    head = handle.read(4)
    if head.startswith(b"\x80"):
        raise CheckpointError(
            f"checkpoint {path} is in torch's legacy format (a bare pickle), which aiayn-train and aiayn-average "
            "never write: save it again with torch.save's default format"
        )
    if head != b"PK\x03\x04":
        raise unreadable(path, "not a zip archive")
    entries, start, length = directory_position(handle, size, path)
    if entries > MAX_RECORDS:
        raise refused(path, f"its archive holds {entries} records (over the {MAX_RECORDS} a checkpoint may)")
    if length > entries * DIRECTORY_ENTRY_BYTES:
        raise refused(path, f"its archive's directory has {length} bytes for {entries} records")
    handle.seek(start)
    directory = handle.read(length)
    records, position = [], 0
    for _ in range(entries):
        record, position = directory_entry(directory, position, path)
        records.append(record)
    check_records(records, size, path)
    return records


def directory_position(handle: BinaryIO, size: int, path: Path) -> tuple[int, int, int]:
    """The number of records, and the offset and length of the directory, from the end record (or its
    zip64 form), which ``torch.save`` writes without a comment at the file's very end."""
    tail_length = min(size, _END.size + _ZIP64_LOCATOR.size + _ZIP64_END.size)
    handle.seek(size - tail_length)
    tail = handle.read(tail_length)
    if len(tail) < _END.size or not tail.endswith(b"\x00\x00") or tail[-_END.size :][:4] != b"PK\x05\x06":
        raise unreadable(path, "no end record where torch.save writes it")
    _, _, _, _, entries, length, start, _ = _END.unpack(tail[-_END.size :])
    end = size - _END.size
    locator = tail[-_END.size - _ZIP64_LOCATOR.size : -_END.size]
    if locator[:4] == b"PK\x06\x07":  # zip64: the reader takes its counts and offsets from the zip64 end record
        end = size - len(tail)
        zip64 = tail[: _ZIP64_END.size]
        if (
            len(tail) < _END.size + _ZIP64_LOCATOR.size + _ZIP64_END.size
            or _ZIP64_LOCATOR.unpack(locator)[2] != end
            or zip64[:4] != b"PK\x06\x06"
        ):
            raise unreadable(path, "its zip64 end record is not where torch.save writes it")
        entries, length, start = _ZIP64_END.unpack(zip64)[7:10]
    if start + length != end:
        raise unreadable(path, "its directory is not where torch.save writes it")
    return entries, start, length


def directory_entry(directory: bytes, position: int, path: Path) -> tuple[Record, int]:
    """The record that the directory entry at ``position`` states, and the next entry's position."""
    fixed = directory[position : position + _ENTRY.size]
    if len(fixed) < _ENTRY.size or fixed[:4] != b"PK\x01\x02":
        raise unreadable(path, "its directory ends early")
    fields = _ENTRY.unpack(fixed)
    method, offset = fields[4], fields[16]
    stored, size, name_length, extra_length, comment_length = fields[8:13]
    name_end = position + _ENTRY.size + name_length
    extra = directory[name_end : name_end + extra_length]
    following = name_end + extra_length + comment_length
    if following > len(directory):
        raise unreadable(path, "its directory ends early")
    size, stored, offset = zip64_sizes(extra, (size, stored, offset))
    name = directory[position + _ENTRY.size : name_end].decode("utf-8", "replace")
    return Record(name, method, stored, size, offset), following


def zip64_sizes(extra: bytes, values: tuple[int, int, int]) -> tuple[int, int, int]:
    """``values`` (size, stored size, offset) with those that are 0xFFFFFFFF taken from the zip64 extra field."""
    position = 0
    while position + 4 <= len(extra):
        kind, length = struct.unpack_from("<2H", extra, position)
        if position + 4 + length > len(extra):
            break  # a field cut short: the zip reader ignores it too
        if kind == _ZIP64_EXTRA:
            wide = iter(struct.unpack_from(f"<{length // 8}Q", extra, position + 4))
            size, stored, offset = (next(wide, value) if value == _FULL32 else value for value in values)
            return size, stored, offset
        position += 4 + length
    return values


def check_records(records: list[Record], size: int, path: Path) -> None:
    """No record is compressed, named twice, or reaches past the file, and together they fit in it."""
    for record in records:
        if record.method != 0:
            raise refused(
                path,
                f"its record {record.name[:80]} is compressed (method {record.method}, {record.stored} bytes "
                f"for {record.size}); torch.save stores its records as they are",
            )
        if record.stored != record.size:
            raise refused(path, f"its record {record.name[:80]} states {record.stored} bytes stored for {record.size}")
        if record.offset + record.size > size:
            raise refused(path, f"its record {record.name[:80]} states {record.size} bytes, beyond the file's {size}")
    twice = [name for name, count in Counter(record.name for record in records).items() if count > 1]
    if twice:
        raise refused(path, f"its archive names the record {twice[0][:80]} twice")
    total = sum(record.size for record in records)
    if total > size:
        raise refused(path, f"its records state {total} bytes together, more than the file's {size}")


def pickle_record(records: list[Record], size: int, path: Path) -> tuple[int, Record]:
    """The number of tensor storages and the record of the pickle, found as ``torch.load`` finds them: in
    the folder of the archive's first record. Every other record is a few bytes of bookkeeping."""
    if not records or "/" not in records[0].name:
        raise unreadable(path, "its archive has no folder of records")
    folder = records[0].name.split("/", 1)[0] + "/"
    storages = sum(record.name.startswith(folder + "data/") for record in records)
    pickled = [record for record in records if record.name == folder + "data.pkl"]
    if not pickled:
        raise unreadable(path, f"its archive has no {folder}data.pkl")
    for record in records:
        if record.size > METADATA_BYTES and record is not pickled[0] and not record.name.startswith(folder + "data/"):
            raise refused(path, f"its record {record.name[:80]} has {record.size} bytes (over {METADATA_BYTES})")
    limit = pickle_limit(storages)
    if pickled[0].size > limit:
        raise refused(
            path,
            f"its pickle has {pickled[0].size} bytes (over the {limit} of a checkpoint with {storages} tensor "
            "storages)",
        )
    return storages, pickled[0]


def record_bytes(handle: BinaryIO, record: Record, size: int, path: Path) -> bytes:
    """The bytes of a stored ``record``, which start after its local header as the zip reader finds them."""
    handle.seek(record.offset)
    header = handle.read(_LOCAL.size)
    if len(header) < _LOCAL.size or header[:4] != b"PK\x03\x04":
        raise unreadable(path, f"no local header for its record {record.name[:80]}")
    name_length, extra_length = _LOCAL.unpack(header)[-2:]
    start = record.offset + _LOCAL.size + name_length + extra_length
    if start + record.size > size:
        raise refused(path, f"its record {record.name[:80]} states {record.size} bytes, beyond the file's {size}")
    handle.seek(start)
    return handle.read(record.size)
