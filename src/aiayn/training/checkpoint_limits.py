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
* ``data.pkl`` is at most :data:`PICKLE_BASE` plus :data:`PICKLE_PER_STORAGE` per tensor storage (the
  model's own size: aiayn's pickle holds each tensor's name and rebuild call, and once the config, the
  tokenizer and the loops' state);
* its opcodes are walked once, in linear time, each stated length checked before anything is read:
  at most :data:`OPS_BASE` plus :data:`OPS_PER_STORAGE` per storage opcodes, strings of at most
  :data:`MAX_TEXT` bytes, nesting of at most :data:`MAX_DEPTH`, only the globals that build an aiayn
  checkpoint (tensors over their storages, plain data; none that allocates what the pickle states, such as
  ``bytearray(n)`` or a codec that doubles a string), and, unfolded as a tree (every reference to an earlier
  object written out again), at most :data:`UNFOLDED_PER_BYTE` times its own length plus :data:`UNFOLDED_BASE`.

The check holds the pickle (at most 20 MiB, with :data:`MAX_RECORDS` storages) and about 80 bytes per
opcode: for the largest pickle the limits admit (655,000 opcodes) under 1 s and 51 MiB, measured on 2 CPU
cores; the hostile files of ``tests/training/test_checkpoint_limits.py`` are refused within 2 s and 64 MiB.
A file that is not a zip archive is refused too: aiayn never writes torch's legacy pickle format.
"""

from __future__ import annotations

import os
import pickle
import struct
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING  # the names protocol 2 gives, as torch maps them
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from aiayn.errors import CheckpointError

MiB = 1 << 20
# The storages of the weights, Adam's three states of each and the EMA: about 1,000 for the big model,
# 1,400 for Table 3's eight layers.
MAX_RECORDS = 4096
METADATA_BYTES = 1024  # a record of torch's bookkeeping (version, byteorder, serialization id): a few bytes
DIRECTORY_ENTRY_BYTES = 1024  # a directory entry: 46 bytes, the record's name (the file's stem) and zip64 sizes
# The pickle of a checkpoint without tensors (config, tokenizer of a few MB, loops, every rank's random
# states), and the pickle's bytes and opcodes per storage: a smoke run's last.ckpt has 180 bytes and 42
# opcodes per storage in its state_dict, 15,000 bytes and 470 opcodes for the rest.
PICKLE_BASE = 16 * MiB
PICKLE_PER_STORAGE = 1024
OPS_BASE = 1 << 17
OPS_PER_STORAGE = 128
MAX_TEXT = 8 * MiB  # one string: the tokenizer's model, as protocol 2 writes bytes (latin-1 text in UTF-8)
MAX_DEPTH = 64  # the load's checks refuse containers nested deeper than 32; a tensor adds 5 levels
MAX_GLOBAL_LINE = 256  # "torch._utils" and "_rebuild_tensor_v2": a module's and a name's line
# Unfolded, aiayn's pickles are 1.3 times their length (each tensor refers again to its rebuild function,
# its storage's type and the names of its optimizer states).
UNFOLDED_PER_BYTE = 8
UNFOLDED_BASE = MiB

# The globals of an aiayn checkpoint, besides torch's dtypes and storage types: tensors rebuilt as views
# of their stored storages, OrderedDicts, bytes (encode(text, "latin1")), and plain data that Lightning
# or a callback may store. Not: those that allocate what the pickle states (bytearray(n), storages and
# tensors by size, quantized tensors), other codecs, or tensors that the load's checks refuse anyway.
PLAIN_GLOBALS = frozenset(
    {
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_tensor_v3",
        "torch._utils._rebuild_parameter",
        "collections.OrderedDict",
        "collections.Counter",
        "builtins.set",
        "builtins.complex",
        "torch.Size",
        "torch.device",
        "_codecs.encode",
    }
)
ALLOCATING_STORAGES = frozenset({"UntypedStorage", "TypedStorage"})
# The opcodes of numbers, None and booleans, and the length of their argument.
CONSTANTS = {pickle.NONE: 0, pickle.NEWFALSE: 0, pickle.NEWTRUE: 0, pickle.BININT1: 1, pickle.BININT2: 2,
             pickle.BININT: 4, pickle.BINFLOAT: 8}  # fmt: skip

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


@dataclass(frozen=True)
class Budget:
    """The limits of a checkpoint with ``storages`` tensor storages whose pickle has ``pickle_bytes``."""

    storages: int
    pickle_bytes: int

    @property
    def opcodes(self) -> int:
        return OPS_BASE + OPS_PER_STORAGE * self.storages

    @property
    def unfolded(self) -> int:
        return UNFOLDED_BASE + UNFOLDED_PER_BYTE * self.pickle_bytes


def pickle_limit(storages: int) -> int:
    """The most bytes of ``data.pkl`` in a checkpoint of ``storages`` tensor storages."""
    return PICKLE_BASE + PICKLE_PER_STORAGE * storages


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


def unreadable(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} cannot be read; it is truncated or not a PyTorch checkpoint ({why})")


def refused(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path}: {what}; it was not written by aiayn-train or aiayn-average")


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


def plain_global(name: str) -> bool:
    """Whether the global ``name`` (``module.name``) builds part of an aiayn checkpoint: see :data:`PLAIN_GLOBALS`."""
    module, _, attribute = name.rpartition(".")
    if name in PLAIN_GLOBALS:
        return True
    if module != "torch":
        return False
    # dtypes (torch.float32) and storage types (torch.FloatStorage), which name what a storage holds
    return isinstance(getattr(torch, attribute, None), torch.dtype) or (
        attribute.endswith("Storage") and attribute not in ALLOCATING_STORAGES and hasattr(torch, attribute)
    )


class Node:
    """What the walk knows of an object the pickle builds, beyond the bytes it unfolds to (a number,
    string or None is that size alone, an ``int`` on the walk's stack): how deep it nests, the name of a
    global or the codec name "latin1" (``tag``), a tuple's parts, and whether the memo referred to it again
    (``shared``: a change to it would then change each place it is in)."""

    __slots__ = ("depth", "parts", "shared", "size", "tag")

    def __init__(self, size: int, depth: int = 1, tag: str | None = None, parts: tuple[Item, ...] = ()) -> None:
        self.size, self.depth, self.tag, self.parts, self.shared = size, depth, tag, parts, False


Item = int | Node  # an int: the size of a number, string or None, which nothing fills or calls


def size_of(item: Item) -> int:
    return item if isinstance(item, int) else item.size


def depth_of(item: Item) -> int:
    return 1 if isinstance(item, int) else item.depth


class PickleWalk:
    """One pass over a pickle's opcodes (those ``torch.load``'s ``weights_only`` reader reads), with a
    stack of sizes and :class:`Node` in place of the objects: every length is checked before it is read,
    every size before it is added, so the walk takes time and memory linear in the pickle's length."""

    def __init__(self, data: bytes, budget: Budget, path: Path) -> None:
        self.data, self.budget, self.path = data, budget, path
        self.position = 0
        self.stack: list[Item] = []
        self.marks: list[int] = []
        self.memo: dict[int, Item] = {}
        self.constants = {code[0]: length for code, length in CONSTANTS.items()}
        # The string "latin1" as either opcode writes it: a string never changes, so one node each, shared
        # from the start so that nothing fills it.
        self.latin1 = {overhead: Node(overhead + 6, tag="latin1") for overhead in (2, 5)}
        for node in self.latin1.values():
            node.shared = True
        self.steps = {
            pickle.PROTO[0]: lambda: self.take(1),
            pickle.EMPTY_LIST[0]: lambda: self.stack.append(Node(1)),
            pickle.EMPTY_DICT[0]: lambda: self.stack.append(Node(1)),
            pickle.EMPTY_SET[0]: lambda: self.stack.append(Node(1)),
            pickle.EMPTY_TUPLE[0]: lambda: self.stack.append(Node(1)),
            pickle.LONG1[0]: lambda: self.stack.append(2 + len(self.take(self.take(1)[0]))),
            pickle.SHORT_BINSTRING[0]: lambda: self.text(self.take(1)[0], 2),
            pickle.BINUNICODE[0]: lambda: self.text(self.unsigned(4), 5),
            pickle.GLOBAL[0]: self.global_,
            pickle.MARK[0]: self.mark,
            pickle.TUPLE[0]: lambda: self.tuple_(self.pop_mark()),
            pickle.TUPLE1[0]: lambda: self.tuple_(self.pop(1)),
            pickle.TUPLE2[0]: lambda: self.tuple_(self.pop(2)),
            pickle.TUPLE3[0]: lambda: self.tuple_(self.pop(3)),
            pickle.APPEND[0]: lambda: self.grow(self.pop(1)),
            pickle.APPENDS[0]: lambda: self.grow(self.pop_mark()),
            pickle.SETITEM[0]: lambda: self.grow(self.pop(2)),
            pickle.SETITEMS[0]: lambda: self.grow(self.pop_mark()),
            pickle.BUILD[0]: lambda: self.grow(self.pop(1)),
            pickle.REDUCE[0]: self.reduce,
            pickle.NEWOBJ[0]: lambda: self.push(self.built(self.pop(2))),
            pickle.BINPERSID[0]: lambda: self.push(self.built(self.pop(1))),
            pickle.BINGET[0]: lambda: self.get(self.unsigned(1)),
            pickle.LONG_BINGET[0]: lambda: self.get(self.unsigned(4)),
            pickle.BINPUT[0]: lambda: self.put(self.unsigned(1)),
            pickle.LONG_BINPUT[0]: lambda: self.put(self.unsigned(4)),
        }

    def run(self) -> None:
        """Walk to the pickle's STOP; a :class:`CheckpointError` for the first limit it passes."""
        data, stack, constants, steps = self.data, self.stack, self.constants, self.steps
        for _ in range(self.budget.opcodes):
            if self.position >= len(data):
                raise unreadable(self.path, "its pickle ends before its STOP")
            code = data[self.position]
            self.position += 1
            if code in constants:  # the most frequent opcodes, kept short
                stack.append(1 + len(self.take(constants[code])))
            elif code in steps:
                steps[code]()
            elif code == pickle.STOP[0] and stack:
                return
            else:
                raise unreadable(self.path, f"its pickle holds opcode {bytes([code])!r} where torch reads none")
        raise refused(
            self.path,
            f"its pickle has more than {self.budget.opcodes} opcodes (the most for a checkpoint with "
            f"{self.budget.storages} tensor storages)",
        )

    def advance(self, length: int) -> int:
        """Where the next ``length`` bytes of the pickle start, which must hold them; past them afterwards."""
        if length > len(self.data) - self.position:
            raise unreadable(
                self.path, f"its pickle states {length} bytes where {len(self.data) - self.position} are left"
            )
        self.position += length
        return self.position - length

    def take(self, length: int) -> bytes:
        start = self.advance(length)
        return self.data[start : start + length]

    def unsigned(self, length: int) -> int:
        return int.from_bytes(self.take(length), "little")

    def text(self, length: int, overhead: int) -> None:
        """A string: its size (no more than the pickle's length, within the unfolded limit), or a node
        for the codec name of bytes, which :meth:`reduce` checks."""
        if length > MAX_TEXT:
            raise refused(self.path, f"its pickle states a string of {length} bytes (over the {MAX_TEXT} one may have)")
        start = self.advance(length)  # not copied: only the walk's size of it is kept
        latin1 = length == len(b"latin1") and self.data[start : start + length] == b"latin1"
        self.stack.append(self.latin1[overhead] if latin1 else overhead + length)

    def global_(self) -> None:
        module, name = self.line(), self.line()
        module, name = NAME_MAPPING.get((module, name), (IMPORT_MAPPING.get(module, module), name))
        dotted = f"{module}.{name}"
        if not plain_global(dotted):
            raise CheckpointError(
                f"checkpoint {self.path} holds {dotted[:80]} objects, not only tensors and plain data; those are "
                "not loaded (weights_only=True): it was not written by aiayn-train or aiayn-average"
            )
        self.stack.append(Node(3 + len(dotted), tag=dotted))

    def line(self) -> str:
        end = self.data.find(b"\n", self.position, self.position + MAX_GLOBAL_LINE)
        if end < 0:
            raise refused(self.path, f"its pickle names a global in over {MAX_GLOBAL_LINE} bytes")
        return self.take(end + 1 - self.position)[:-1].decode("utf-8", "replace")

    def mark(self) -> None:
        if len(self.marks) >= MAX_DEPTH:
            raise refused(self.path, f"its pickle nests over {MAX_DEPTH} marks")
        self.marks.append(len(self.stack))

    def pop_mark(self) -> list[Item]:
        if not self.marks:
            raise unreadable(self.path, "its pickle closes a mark it did not open")
        return self.pop(len(self.stack) - self.marks.pop())

    def pop(self, count: int) -> list[Item]:
        if count > len(self.stack):
            raise unreadable(self.path, "its pickle takes more from its stack than it put there")
        taken = self.stack[len(self.stack) - count :]
        del self.stack[len(self.stack) - count :]
        return taken

    def push(self, node: Node) -> None:
        if node.depth > MAX_DEPTH:
            raise refused(self.path, f"its pickle nests objects over {MAX_DEPTH} deep")
        if node.size > self.budget.unfolded:
            raise refused(
                self.path,
                f"its pickle refers to earlier objects so often that it unfolds to {node.size} bytes or more (over "
                f"the {self.budget.unfolded} a pickle of {self.budget.pickle_bytes} bytes may)",
            )
        self.stack.append(node)

    def built(self, parts: list[Item]) -> Node:
        """The object that ``parts`` build (a call, a tuple), unfolded: all of them and one opcode."""
        return Node(1 + sum(map(size_of, parts)), 1 + max(map(depth_of, parts), default=0))

    def tuple_(self, parts: list[Item]) -> None:
        node = self.built(parts)
        node.parts = tuple(parts)
        self.push(node)

    def reduce(self) -> None:
        func, args = self.pop(2)
        codec = [getattr(part, "tag", None) for part in args.parts[1:]] if isinstance(args, Node) else []
        if getattr(func, "tag", None) == "_codecs.encode" and codec != ["latin1"]:
            raise refused(
                self.path, "its pickle encodes bytes with another codec than latin1, as protocol 2 writes them"
            )
        self.push(self.built([func, args]))

    def grow(self, parts: list[Item]) -> None:
        """APPEND(S), SETITEM(S), BUILD: ``parts`` go into the object below them on the stack."""
        (target,) = self.pop(1)
        if not isinstance(target, Node):
            raise unreadable(self.path, "its pickle adds to a number or a string")
        if target.shared:  # its earlier places would grow too: the walk's sizes would not hold
            raise refused(self.path, "its pickle changes an object after referring to it again")
        target.size += 1 + sum(map(size_of, parts))
        target.depth = max(target.depth, 1 + max(map(depth_of, parts), default=0))
        self.push(target)

    def get(self, index: int) -> None:
        item = self.memo.get(index)
        if item is None:
            raise unreadable(self.path, f"its pickle refers to memo entry {index}, which it never stored")
        if isinstance(item, Node):
            item.shared = True
        self.stack.append(item)

    def put(self, index: int) -> None:
        if not self.stack:
            raise unreadable(self.path, "its pickle stores an object before building one")
        self.memo[index] = self.stack[-1]
