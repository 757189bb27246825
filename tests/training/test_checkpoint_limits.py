"""A shared checkpoint is bounded before it is unpickled: a file built to exhaust the machine (references to
earlier objects that unfold exponentially, strings of any length, compressed or overlapping records, deep
nesting, too many records, globals that allocate what the pickle states) is refused in one line within
2 seconds and 64 MiB, and aiayn's own checkpoints still load."""

from __future__ import annotations

import pickle
import random
import re
import struct
import time
import tracemalloc
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.errors import CheckpointError
from aiayn.model import Transformer, TransformerConfig
from aiayn.training.checkpoint_limits import MAX_RECORDS
from aiayn.training.checkpoint_pickle import MAX_TEXT, OPS_BASE, PICKLE_BASE
from aiayn.training.checkpoints import check_tensor_sizes, load_checkpoint, save_checkpoint

MiB = 1 << 20
SECONDS = 2.0
MEMORY = 64 * MiB  # peak of the refusal's allocations, traced
# The records torch.save writes beside the pickle and the storages.
BOOKKEEPING = {".format_version": b"1", ".storage_alignment": b"64", "byteorder": b"little", "version": b"3\n"}


def aiayn_checkpoint(n_layers: int = 2, tokenizer_bytes: int = 4 * MiB) -> dict[str, Any]:
    """A checkpoint as aiayn-train writes one, of a small model after one Adam step: its weights (tied
    embeddings), Adam's states, the EMA, every rank's random states, loops, the config and a tokenizer of
    random bytes (a large sentencepiece model's size, and the worst case of protocol 2's latin-1 text)."""
    cfg = TransformerConfig(vocab_size=64, n_layers=n_layers, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8)
    model = Transformer(cfg)
    optimizer = torch.optim.Adam(model.parameters())
    sum(parameter.sum() for parameter in model.parameters()).backward()
    optimizer.step()
    weights = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    return {
        "epoch": 3,
        "global_step": 1200,
        "state_dict": weights,
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [{"last_epoch": 1200, "base_lrs": [1.0]}],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 3, "completed": 2}}}},
        "callbacks": {
            "ExponentialMovingAverage": {"weights": {name: tensor.clone() for name, tensor in weights.items()}},
            "RandomState": {"ranks": [{"torch": torch.get_rng_state(), "python": random.getstate()} for _ in range(8)]},
        },
        "hyper_parameters": {"model": cfg.to_dict(), "betas": [0.9, 0.98]},
        "aiayn": {
            "config": {"seed": 1, "data": {"src_lang": "en", "tgt_lang": "de"}, "model": cfg.to_dict()},
            "tokenizer": random.Random(0).randbytes(tokenizer_bytes),
            "overrides": ["model=tiny"],
        },
    }


def torch_zip(
    path: Path, pickled: bytes, records: dict[str, bytes] | None = None, deflated: tuple[str, ...] = ()
) -> Path:
    """A zip archive laid out as torch.save writes one: ``archive/data.pkl`` first, then the bookkeeping and
    ``records`` (which replace bookkeeping of the same name), every record stored but those in ``deflated``."""
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in {"data.pkl": pickled, **BOOKKEEPING, **(records or {})}.items():
            archive.writestr(f"archive/{name}", data, zipfile.ZIP_DEFLATED if name in deflated else zipfile.ZIP_STORED)
    return path


def rezipped(path: Path, obj: Any, records: dict[str, bytes] | None = None, deflated: tuple[str, ...] = ()) -> Path:
    """``obj`` as torch.save writes it, its records written again by :func:`torch_zip`."""
    torch.save(obj, path)
    with zipfile.ZipFile(path) as archive:
        folder = archive.namelist()[0].split("/")[0]
        saved = {info.filename.removeprefix(f"{folder}/"): archive.read(info) for info in archive.infolist()}
    return torch_zip(path, saved.pop("data.pkl"), {**saved, **(records or {})}, deflated)


def patched_directory(path: Path, name: str, size: int, offset_of: str | None = None) -> Path:
    """``path`` with the directory entry of record ``name`` stating ``size`` bytes (stored and held) and,
    if given, the local header of record ``offset_of``: a record that claims bytes it does not have."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        offsets = {info.filename: info.header_offset for info in archive.infolist()}
    entry = struct.unpack_from("<L", data, data.rindex(b"PK\x05\x06") + 16)[0]  # the directory's first entry
    name_length, extra_length, comment_length = struct.unpack_from("<3H", data, entry + 28)
    while data[entry + 46 : entry + 46 + name_length] != name.encode():
        entry += 46 + name_length + extra_length + comment_length
        name_length, extra_length, comment_length = struct.unpack_from("<3H", data, entry + 28)
    struct.pack_into("<2L", data, entry + 20, size, size)
    if offset_of is not None:
        struct.pack_into("<L", data, entry + 42, offsets[offset_of])
    path.write_bytes(bytes(data))
    return path


def twice(path: Path) -> Path:
    """A tensor's checkpoint whose storage record is written a second time, as zipfile lets one do."""
    rezipped(path, {"w": torch.zeros(4)})
    with zipfile.ZipFile(path, "a") as archive, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zipfile's "Duplicate name"
        archive.writestr("archive/data/0", bytes(16))
    return path


# Pickle opcodes, as protocol 2 writes them.
def text(value: str) -> bytes:
    encoded = value.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(encoded)) + encoded


def get(index: int) -> bytes:
    return pickle.BINGET + bytes([index]) if index < 256 else pickle.LONG_BINGET + struct.pack("<I", index)


def put(index: int) -> bytes:
    return pickle.BINPUT + bytes([index]) if index < 256 else pickle.LONG_BINPUT + struct.pack("<I", index)


def as_checkpoint(*body: bytes) -> bytes:
    """A pickle of ``{"state": (what body builds, ...)}``."""
    head = pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + text("state") + pickle.MARK
    return head + b"".join(body) + pickle.TUPLE + pickle.SETITEM + pickle.STOP


def memo_bomb(levels: int = 30, fan_out: int = 16) -> bytes:
    """A tuple of tuples, each of ``fan_out`` references to the one before: 1 kB that unfolds to 16**30
    objects, 31 deep (within the 32 levels the load's own walk allows)."""
    body = [pickle.EMPTY_TUPLE, put(0)]
    for level in range(1, levels + 1):
        body += [pickle.MARK, get(level - 1) * fan_out, pickle.TUPLE, put(level)]
    return as_checkpoint(*body)


def shared_string(length: int = MiB, references: int = 5000) -> bytes:
    """A list that refers ``references`` times to one string of ``length`` bytes: 1 MB, 5 GB unfolded."""
    return as_checkpoint(
        text("x" * length), put(0), pickle.EMPTY_LIST + pickle.MARK + get(0) * references + pickle.APPENDS
    )


def codec_chain(levels: int = 30) -> bytes:
    """bytes encoded as hex again and again: each call doubles them, 2 bytes become 2 GiB."""
    call = get(0) + text("ab") + text("latin1") + pickle.TUPLE2 + pickle.REDUCE
    for _ in range(levels):
        call = get(0) + call + text("hex") + pickle.TUPLE2 + pickle.REDUCE
    return as_checkpoint(pickle.GLOBAL + b"_codecs\nencode\n" + put(0), call)


def allocating_call() -> bytes:
    """bytearray(2**31 - 1): 2 GiB from a few bytes (protocol 2 names builtins __builtin__)."""
    return (
        pickle.GLOBAL
        + b"__builtin__\nbytearray\n"
        + pickle.BININT
        + struct.pack("<i", 2**31 - 1)
        + pickle.TUPLE1
        + pickle.REDUCE
    )


def hostile_files() -> dict[str, tuple[Callable[[Path], Path], str]]:
    """Each hostile file (built in a folder) and the refusal it must get."""
    tensor = {"w": torch.zeros(4)}
    stated = pickle.BINUNICODE + struct.pack("<I", 2**32 - 1) + b"abc"
    return {
        "memo bomb": (
            lambda f: torch_zip(f / "a.ckpt", memo_bomb()),
            r"refers to earlier objects so often that it unfolds to \d+ bytes or more \(over the \d+ a pickle of "
            r"\d+ bytes may\)",
        ),
        "one string referred to 5000 times": (
            lambda f: torch_zip(f / "a.ckpt", shared_string()),
            "refers to earlier objects so often that it unfolds",
        ),
        "a string's stated length": (
            lambda f: torch_zip(f / "a.ckpt", as_checkpoint(stated)),
            rf"states a string of 4294967295 bytes \(over the {MAX_TEXT} one may have\)",
        ),
        "a string over the limit": (
            lambda f: torch_zip(f / "a.ckpt", as_checkpoint(text("x" * (MAX_TEXT + 1)))),
            rf"states a string of {MAX_TEXT + 1} bytes",
        ),
        "a pickle over the limit": (
            lambda f: torch_zip(f / "a.ckpt", as_checkpoint(text("x" * (PICKLE_BASE + 1)))),
            rf"its pickle has \d+ bytes \(over the {PICKLE_BASE} of a checkpoint with 0 tensor storages\)",
        ),
        "a deflated storage": (
            lambda f: rezipped(f / "a.ckpt", {"w": torch.zeros(16 * MiB)}, deflated=("data/0",)),
            r"its record archive/data/0 is compressed \(method 8, \d+ bytes for 67108864\); torch\.save stores",
        ),
        "a deflated pickle": (
            lambda f: torch_zip(f / "a.ckpt", as_checkpoint(text("x" * 64 * MiB)), deflated=("data.pkl",)),
            r"its record archive/data\.pkl is compressed",
        ),
        "a storage beyond the file": (
            lambda f: patched_directory(rezipped(f / "a.ckpt", tensor), "archive/data/0", size=2**32 - 2),
            r"its record archive/data/0 states 4294967294 bytes, beyond the file's \d+",
        ),
        "overlapping storages": (
            lambda f: overlapping(f / "a.ckpt"),
            r"its records state \d+ bytes together, more than the file's \d+",
        ),
        "a record named twice": (
            lambda f: twice(f / "a.ckpt"),
            "its archive names the record archive/data/0 twice",
        ),
        "too many records": (
            lambda f: torch_zip(f / "a.ckpt", as_checkpoint(), {f"data/{i}": b"" for i in range(MAX_RECORDS)}),
            rf"its archive holds {MAX_RECORDS + 5} records \(over the {MAX_RECORDS} a checkpoint may\)",
        ),
        "a large bookkeeping record": (
            lambda f: torch_zip(f / "a.ckpt", as_checkpoint(), {".storage_alignment": b"0" * 8 * MiB}),
            r"its record archive/\.storage_alignment has 8388608 bytes \(over 1024\)",
        ),
        "deep lists": (
            lambda f: torch_zip(f / "a.ckpt", as_checkpoint(pickle.EMPTY_LIST * 100 + pickle.APPEND * 99)),
            "its pickle nests objects over 64 deep",
        ),
        "deep marks": (
            lambda f: torch_zip(f / "a.ckpt", as_checkpoint(pickle.MARK * 100_000)),
            "its pickle nests over 64 marks",
        ),
        "too many opcodes": (
            lambda f: torch_zip(f / "a.ckpt", as_checkpoint(pickle.NONE * 200_000)),
            rf"its pickle has more than {OPS_BASE} opcodes \(the most for a checkpoint with 0 tensor storages\)",
        ),
        "bytearray(n)": (
            lambda f: torch_zip(f / "a.ckpt", as_checkpoint(allocating_call())),
            r"holds builtins\.bytearray objects, not only tensors and plain data",
        ),
        "a codec that doubles bytes": (
            lambda f: torch_zip(f / "a.ckpt", codec_chain()),
            "its pickle encodes bytes with another codec than latin1",
        ),
        "torch's legacy format": (
            lambda f: legacy(f / "a.ckpt", tensor),
            r"is in torch's legacy format \(a bare pickle\), which aiayn-train and aiayn-average never write",
        ),
    }


def overlapping(path: Path) -> Path:
    """16 records that each state the same MiB of the file: torch would read it 16 times."""
    rezipped(path, {"w": torch.zeros(MiB // 4)}, records={f"data/{i}": b"x" for i in range(1, 16)})
    for i in range(1, 16):
        patched_directory(path, f"archive/data/{i}", size=MiB, offset_of="archive/data/0")
    return path


def legacy(path: Path, obj: Any) -> Path:
    torch.save(obj, path, _use_new_zipfile_serialization=False)
    return path


HOSTILE = hostile_files()


def refusal(path: Path) -> tuple[str, float, int]:
    """The message that refuses the checkpoint at ``path``, the seconds it took, and the peak of the
    memory allocated meanwhile (traced on a second try: tracing slows the first down)."""
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(path)
    seconds = time.perf_counter() - start
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError):
            load_checkpoint(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return str(refused.value), seconds, peak


@pytest.mark.parametrize("case", HOSTILE, ids=list(HOSTILE))
def test_a_hostile_checkpoint_is_refused_in_one_line_quickly_and_in_bounded_memory(tmp_path: Path, case: str) -> None:
    build, message = HOSTILE[case]
    path = build(tmp_path)
    line, seconds, peak = refusal(path)
    assert "\n" not in line and line.startswith(f"checkpoint {path}"), line
    assert re.search(message, line), line
    assert seconds < SECONDS, f"{case}: refused after {seconds:.2f} s"
    assert peak < MEMORY, f"{case}: {peak / MiB:.1f} MiB allocated to refuse it"


@pytest.mark.parametrize("n_layers", [2, 8])
def test_aiayn_checkpoints_load_whole(tmp_path: Path, n_layers: int) -> None:
    """Table 3's eight layers with Adam and the EMA: 1,300 storages; and a 4 MiB tokenizer."""
    checkpoint = aiayn_checkpoint(n_layers)
    path = tmp_path / "last.ckpt"
    save_checkpoint(checkpoint, path)
    for mmap in (False, True):
        loaded = load_checkpoint(path, mmap=mmap)
        assert loaded["aiayn"] == checkpoint["aiayn"] and loaded["state_dict"].keys() == checkpoint["state_dict"].keys()
        assert all(torch.equal(loaded["state_dict"][k], v) for k, v in checkpoint["state_dict"].items())
        assert loaded["optimizer_states"][0]["state"].keys() == checkpoint["optimizer_states"][0]["state"].keys()


def test_a_checkpoint_rewritten_by_zipfile_loads_and_so_does_its_zip64_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hostile files above are this one with one thing changed; zip64 (sizes and offsets in extra
    fields and an end record of its own) is how torch.save writes a checkpoint of over 4 GiB."""
    checkpoint = {"state_dict": {"w": torch.arange(6.0), "v": torch.ones(2, 3)}, "aiayn": {"tokenizer": b"\xff\x00"}}
    plain = rezipped(tmp_path / "plain.ckpt", checkpoint)
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 0)
    wide = rezipped(tmp_path / "wide.ckpt", checkpoint)
    assert b"PK\x06\x06" in wide.read_bytes() and b"PK\x06\x06" not in plain.read_bytes()
    for path in (plain, wide):
        loaded = load_checkpoint(path)
        assert torch.equal(loaded["state_dict"]["v"], torch.ones(2, 3)) and loaded["aiayn"] == checkpoint["aiayn"]


def test_the_tensor_check_walks_each_container_once(tmp_path: Path) -> None:
    """Tuples that refer 16 times to the one before, 30 deep (as deep as the check allows): 16**30 paths
    to a tensor, 31 containers."""

    def shared(leaf: torch.Tensor) -> dict[str, Any]:
        node: Any = leaf
        for _ in range(30):
            node = (node,) * 16
        return {"state": node}

    start = time.perf_counter()
    check_tensor_sizes(shared(torch.zeros(1)), tmp_path)
    assert time.perf_counter() - start < SECONDS
    with pytest.raises(CheckpointError, match=r"state(\[0\])+ is a tensor of 1000000 numbers stored in 4 bytes"):
        check_tensor_sizes(shared(torch.zeros(1).expand(10**6)), tmp_path)
