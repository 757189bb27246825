"""Cache entries that can tell whether they are whole, so that a damaged one is rebuilt, not loaded.

An entry (the sentencepiece model; the ids of one split in one language) is a few files, each written
atomically, and then its manifest ``<entry>.manifest.json``, written last: the size and a SHA-256
checksum of each file. An entry is used only when its manifest is there and every file matches it;
anything else (a crash between two files, a full disk, a file emptied or cut short, a concurrent
writer of other content) is rebuilt. Writers never delete: they rename whole files over old ones.

Checking must not slow every run down: a file up to :data:`WHOLE_LIMIT` is hashed whole (0.5 ms for
the ids of Multi30k's training split, about 1 MB), a larger one (WMT14's training ids, gigabytes)
through :data:`BLOCKS` blocks spread over it, first and last included. Its size and those blocks catch
a file cut short, zero-filled after a crash, or replaced; not a single flipped bit inside.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiayn.errors import DataError
from aiayn.files import atomic_write, open_plain, read_plain_file

log = logging.getLogger(__name__)

BLOCK = 1 << 20  # bytes read per block
BLOCKS = 64  # blocks hashed of a file larger than WHOLE_LIMIT
WHOLE_LIMIT = BLOCK * BLOCKS
MANIFEST_BYTES = 1 << 20  # a manifest names a few files: kilobytes
NO_MANIFEST = "no manifest"  # the one reason that is not damage when the entry has no file either


def checksum(path: Path, size: int) -> str:
    """SHA-256 of the ``size`` bytes of ``path``: all of them up to :data:`WHOLE_LIMIT`, else
    :data:`BLOCKS` evenly spaced blocks."""
    digest = hashlib.sha256()
    with open_plain(path, follow_links=True) as handle:
        if size <= WHOLE_LIMIT:
            while block := handle.read(4 * BLOCK):
                digest.update(block)
        else:
            for k in range(BLOCKS):
                handle.seek((size - BLOCK) * k // (BLOCKS - 1))
                digest.update(handle.read(BLOCK))
    return digest.hexdigest()


def describe(path: Path) -> dict[str, Any]:
    """What a manifest records of ``path``."""
    size = path.stat().st_size
    return {"bytes": size, "sha256": checksum(path, size)}


@dataclass(frozen=True)
class CacheEntry:
    """Files built and used together: ``files``, the entry's own, and ``inputs``, the files they were
    made from and are valid only with (ids and the sentencepiece model that made them)."""

    name: Path  # the entry, for messages; its manifest is <name>.manifest.json
    files: tuple[Path, ...]
    inputs: tuple[Path, ...] = ()

    @property
    def manifest(self) -> Path:
        return self.name.with_name(f"{self.name.name}.manifest.json")

    def seal(self) -> None:
        """Write the manifest, once every file is in place: from now on the entry is used as it is."""
        files = {path.name: describe(path) for path in (*self.files, *self.inputs)}
        atomic_write(self.manifest, json.dumps({"files": files}, indent=1) + "\n")

    def damage(self) -> str | None:
        """Why the entry cannot be used (no manifest, a file missing or unlike its manifest), or None."""
        try:
            recorded = json.loads(read_plain_file(self.manifest, MANIFEST_BYTES))["files"]
        except FileNotFoundError:
            return NO_MANIFEST
        # Not a plain file, too large, not JSON (or nested deeper than Python parses), no "files".
        except (DataError, OSError, ValueError, RecursionError, KeyError, TypeError):
            return f"{self.manifest.name} cannot be read"
        paths = (*self.files, *self.inputs)
        names = {path.name for path in paths}
        if not isinstance(recorded, dict) or set(recorded) != names or not all(map(_is_record, recorded.values())):
            return f"{self.manifest.name} does not describe {', '.join(sorted(names))}"
        for path in paths:
            if not path.is_file():
                return f"{path.name} is missing"
            found, expected = describe(path), recorded[path.name]
            if found["bytes"] != expected["bytes"]:
                return f"{path.name} has {found['bytes']} bytes, its manifest says {expected['bytes']}"
            if found["sha256"] != expected["sha256"]:
                return f"{path.name} does not match its checksum"
        return None

    def usable(self) -> bool:
        """True when the entry can be loaded as it is. A damaged entry gets one warning and False: the
        caller rebuilds it; an entry never built (no manifest, none of its files) just False."""
        reason = self.damage()
        if reason is None:
            return True
        if reason != NO_MANIFEST or any(path.exists() for path in self.files):
            log.warning("cache entry %s is damaged (%s); rebuilding it", self.name, reason)
        return False


def _is_record(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("bytes"), int) and isinstance(value.get("sha256"), str)
