"""Reading an offline W&B run from its files, as `wandb sync` would upload it.

An offline run keeps its history, config, summary and exit status only in ``run-<id>.wandb``: an
append-only log of protobuf ``Record`` messages in the LevelDB log format (32 KiB blocks; each chunk
has a 7-byte header: CRC-32 seeded with the chunk type, length, type). wandb no longer ships a reader
for it, so the tests read it here, checking every checksum.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    """What an offline run recorded."""

    folder: Path
    run_id: str = ""
    name: str = ""
    group: str = ""
    tags: list[str] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None
    preempting: bool = False  # the run was marked preempting (run.mark_preempting())
    started_ns: int = 0
    artifacts: list[dict[str, Any]] = field(default_factory=list)  # name, type, aliases, metadata, files

    def rows_with(self, key: str) -> list[dict[str, Any]]:
        return [row for row in self.history if key in row]

    @property
    def steps(self) -> list[int]:
        """W&B's step (``_step``) of each history row, in the order they were logged."""
        return [row["_step"] for row in self.history]

    def media(self, kind: str) -> list[Path]:
        """Files under ``files/media/<kind>`` (``table`` or ``images``)."""
        return sorted(p for p in (self.folder / "files" / "media" / kind).rglob("*") if p.is_file())


def records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a W&B transaction log"
    out, pos, buffer = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's trailer is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:  # zero padding
            pos += left
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        assert len(chunk) == length, f"{path}: truncated at byte {pos}"
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad checksum at byte {pos}"
        pos += HEADER + length
        buffer = chunk if kind in (FULL, FIRST) else buffer + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buffer)
            out.append(record)
    return out


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_offline_run(folder: Path) -> OfflineRun:
    """Parse ``<folder>/run-<id>.wandb`` of an ``offline-run-*`` folder."""
    (log,) = folder.glob("run-*.wandb")
    run = OfflineRun(folder=folder)
    for record in records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.name, run.group = record.run.run_id, record.run.display_name, record.run.run_group
            run.tags = list(record.run.tags)
            run.started_ns = record.run.start_time.ToNanoseconds()
            run.config.update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "history":
            run.history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "config":
            run.config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "summary":
            run.summary.update({_key(i): json.loads(i.value_json) for i in record.summary.update})
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
        elif kind == "preempting":
            run.preempting = True
        elif kind == "artifact":
            artifact = record.artifact
            run.artifacts.append({
                "name": artifact.name,
                "type": artifact.type,
                "aliases": list(artifact.aliases),
                "metadata": json.loads(artifact.metadata or "{}"),
                "files": {entry.path: entry.local_path for entry in artifact.manifest.contents},
            })  # fmt: skip
    return run


def offline_runs(run_dir: Path) -> list[OfflineRun]:
    """Every offline W&B run under ``run_dir``, oldest first.

    By the start time each run recorded: the folders' names hold it only to the second, then the id.
    """
    runs = [read_offline_run(folder) for folder in run_dir.rglob("offline-run-*")]
    return sorted(runs, key=lambda run: (run.started_ns, run.folder.name))
