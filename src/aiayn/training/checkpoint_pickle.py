"""The walk over a checkpoint's pickle (``data.pkl``) that :mod:`aiayn.training.checkpoint_limits` makes
before ``torch.load`` unpickles it: references to earlier objects (the memo) can nest containers in
containers, a few bytes for a tree of any size, which every later walk of the checkpoint (its checks, its
config) unfolds, and a stated length can be any number.

The opcodes are walked once, in linear time, each stated length checked before anything is read: at most
:data:`OPS_BASE` plus :data:`OPS_PER_STORAGE` per tensor storage opcodes, strings of at most
:data:`MAX_TEXT` bytes, nesting of at most :data:`MAX_DEPTH`, only the globals that build an aiayn
checkpoint (tensors over their storages, plain data; none that allocates what the pickle states, such as
``bytearray(n)`` or a codec that doubles a string), and, unfolded as a tree (every reference to an earlier
object written out again), at most :data:`UNFOLDED_PER_BYTE` times its own length plus :data:`UNFOLDED_BASE`.
The walk keeps about 80 bytes per opcode.
"""

from __future__ import annotations

import pickle
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING  # the names protocol 2 gives, as torch maps them
from dataclasses import dataclass
from pathlib import Path

import torch

from aiayn.errors import CheckpointError

MiB = 1 << 20
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


def unreadable(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} cannot be read; it is truncated or not a PyTorch checkpoint ({why})")


def refused(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path}: {what}; it was not written by aiayn-train or aiayn-average")


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
