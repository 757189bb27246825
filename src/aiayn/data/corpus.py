"""Parallel corpora: where the sentence pairs of each split come from.

A :class:`ParallelCorpus` gives aligned source/target text by split and row, and a fingerprint of its
content that names its tokenizer cache. Three sources: Multi30k (a local folder or its public
download), WMT14 through Hugging Face ``datasets``, and any aligned pair of plain-text files.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.client
import os
import shutil
import urllib.error
import urllib.request
import zlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aiayn.errors import DataError, FieldError
from aiayn.extras import require, require_installed
from aiayn.files import atomic_write, bounded_lines, open_plain

MULTI30K_URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/{stem}.{lang}.gz"
MULTI30K_SPLITS = {"train": "train", "val": "val", "test": "test_2016_flickr"}
MULTI30K_LANGS = ("en", "de", "fr")


def default_cache_dir() -> Path:
    """``$AIAYN_CACHE``, else ``$XDG_CACHE_HOME/aiayn``, else ``~/.cache/aiayn``."""
    if "AIAYN_CACHE" in os.environ:
        return Path(os.environ["AIAYN_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "aiayn"


def split_file(root: Path, stem: str, lang: str) -> Path:
    """``<root>/<stem>.<lang>`` or its ``.gz`` form, whichever exists."""
    for candidate in (root / f"{stem}.{lang}.gz", root / f"{stem}.{lang}"):
        if candidate.is_file():
            return candidate
    raise DataError(f"{root / f'{stem}.{lang}.gz'} not found (nor the uncompressed {stem}.{lang}); check data.root")


def read_lines(path: Path) -> list[str]:
    """UTF-8 lines without their line ends, read line by line (:func:`~aiayn.files.bounded_lines`): a
    file that is not plain, a line that is not UTF-8 or longer than :data:`~aiayn.files.LINE_BYTES`,
    and a truncated or corrupt ``.gz`` are reported in one line with the file (and line)."""
    try:
        with open_plain(path, follow_links=True) as file:
            stream = gzip.GzipFile(fileobj=file, mode="rb") if path.suffix == ".gz" else file
            return [_decoded(line, path, number) for number, line in enumerate(bounded_lines(stream, str(path)), 1)]
    except (OSError, EOFError, zlib.error) as err:  # unreadable, or a truncated or corrupt .gz
        raise DataError(f"{path}: cannot be read ({err})") from None


def _decoded(line: bytes, path: Path, number: int) -> str:
    try:
        return line.decode("utf-8").rstrip("\r")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}:{number}: invalid UTF-8 ({err.reason} at byte {err.start})") from None


def read_parallel(src_path: Path, tgt_path: Path) -> tuple[list[str], list[str]]:
    """Aligned source and target lines; files of different lengths are an error, not a silent cut."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}; the files must be aligned")
    if not src:
        raise DataError(f"{src_path} is empty")
    return src, tgt


def download_multi30k(target: Path, langs: tuple[str, ...]) -> Path:
    """Fetch the Multi30k task-1 files of ``langs`` into ``target`` (once). Each file is written whole or
    not at all, through a temporary file of its own (:func:`~aiayn.files.atomic_write`): two processes
    downloading at once (the first run of two jobs) each rename a complete copy into place."""
    target.mkdir(parents=True, exist_ok=True)
    for stem in MULTI30K_SPLITS.values():
        for lang in langs:
            path = target / f"{stem}.{lang}.gz"
            if path.is_file():
                continue
            url = MULTI30K_URL.format(stem=stem, lang=lang)
            try:
                with urllib.request.urlopen(url, timeout=60) as response:
                    atomic_write(path, functools.partial(shutil.copyfileobj, response))
            except (urllib.error.URLError, http.client.HTTPException, OSError) as err:  # HTTPException: cut short
                raise DataError(
                    f"could not download Multi30k from {url} ({err}); "
                    "download the task-1 raw files yourself and set data.root=<folder>"
                ) from None
    return target


def file_digest(paths: Sequence[Path]) -> str:
    """SHA-256 over the bytes of ``paths``, read in blocks (corpus files can be gigabytes). Each file's
    size goes in before its bytes, so that the boundaries count: ("ab", "c") is not ("a", "bc")."""
    digest = hashlib.sha256()
    for path in paths:
        with open_plain(path, follow_links=True) as handle:
            digest.update(f"{os.fstat(handle.fileno()).st_size}\n".encode())
            while block := handle.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


class ParallelCorpus(ABC):
    """Sentence pairs in one direction, by split; ``roles`` maps train/val/test to the corpus's splits.

    Implementations must be picklable: parallel encoding hands them to worker processes.
    """

    name: str
    src_lang: str
    tgt_lang: str
    roles: dict[str, str | None]  # role → split name; a role mapped to None is absent (no test split)
    readable_by_workers = False  # True: worker processes read rows themselves (memory-mapped data)
    root: Path | None = None  # data.root, a local folder: relative names (data.extra_train) are in it

    def splits(self) -> list[str]:
        """The splits to encode: those with a role."""
        return sorted({split for split in self.roles.values() if split is not None})

    @abstractmethod
    def fingerprint(self) -> str:
        """Identifies the content of every split in both languages, whichever is the source."""

    @abstractmethod
    def size(self, split: str) -> int:
        """The number of sentence pairs of ``split``."""

    @abstractmethod
    def read(self, split: str, rows: np.ndarray | None = None) -> tuple[list[str], list[str]]:
        """Source and target text of ``rows`` of ``split`` (all rows when None), aligned."""

    @abstractmethod
    def where(self, split: str) -> str:
        """Where ``split`` comes from, for messages (a file, a dataset split)."""

    def at(self, split: str, row: int, lang: str) -> str:
        """Where the ``lang`` side of ``row`` of ``split`` is, for messages."""
        return f"{self.where(split)} row {row}"


class _TextPairs(ParallelCorpus):
    """A corpus made of aligned text files, ``files[split] = (source file, target file)``; each pair of
    files is read (and checked) once per process."""

    def __init__(self) -> None:
        self._text: dict[str, tuple[list[str], list[str]]] = {}

    @abstractmethod
    def files(self, split: str, lang: str) -> Path:
        """The file holding ``split`` in ``lang``."""

    def fingerprint(self) -> str:
        langs = sorted((self.src_lang, self.tgt_lang))
        return file_digest([self.files(split, lang) for split in self.splits() for lang in langs])

    def _pairs(self, split: str) -> tuple[list[str], list[str]]:
        if split not in self._text:
            self._text[split] = read_parallel(self.files(split, self.src_lang), self.files(split, self.tgt_lang))
        return self._text[split]

    def size(self, split: str) -> int:
        return len(self._pairs(split)[0])

    def read(self, split: str, rows: np.ndarray | None = None) -> tuple[list[str], list[str]]:
        src, tgt = self._pairs(split)
        if rows is None:
            return list(src), list(tgt)
        return [src[i] for i in rows.tolist()], [tgt[i] for i in rows.tolist()]

    def where(self, split: str) -> str:
        return str(self.files(split, self.src_lang))

    def at(self, split: str, row: int, lang: str) -> str:
        return f"{self.files(split, lang)}:{row + 1}"  # file:line, as compilers and editors read it

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_text": {}}  # encoding workers get the text chunk by chunk, never all of it


class Multi30k(_TextPairs):
    """Multi30k task 1 (``<root>/<stem>.<lang>[.gz]``); without ``root``, downloaded into ``cache_dir``."""

    name = "multi30k"

    def __init__(
        self, src_lang: str, tgt_lang: str, *, root: Path | None, cache_dir: Path, val_split: str, test_split: str
    ) -> None:
        super().__init__()
        for key, lang in (("src_lang", src_lang), ("tgt_lang", tgt_lang)):
            if lang not in MULTI30K_LANGS:
                allowed = f"is not a language of Multi30k; use one of {', '.join(MULTI30K_LANGS)}"
                raise FieldError(key, lang, allowed)
        for key, split in (("val_split", val_split), ("test_split", test_split)):
            if split not in MULTI30K_SPLITS:
                raise FieldError(key, split, f"must be one of {', '.join(MULTI30K_SPLITS)}")
        if root is not None:  # a local copy must be complete before any work starts
            if not root.is_dir():
                raise FieldError("root", root, "is not a folder; give the folder of the Multi30k files")
            for stem in MULTI30K_SPLITS.values():
                for lang in (src_lang, tgt_lang):
                    split_file(root, stem, lang)
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.root, self.cache_dir = root, cache_dir
        self.roles = {"train": "train", "val": val_split, "test": test_split}
        self._folder: Path | None = root

    def splits(self) -> list[str]:
        return list(MULTI30K_SPLITS)  # all of them: the cache does not depend on val_split/test_split

    def folder(self) -> Path:
        if self._folder is None:  # no local copy: the public one, downloaded once
            self._folder = download_multi30k(self.cache_dir / "multi30k", MULTI30K_LANGS)
        return self._folder

    def files(self, split: str, lang: str) -> Path:
        return split_file(self.folder(), MULTI30K_SPLITS[split], lang)


class TextFiles(_TextPairs):
    """Any aligned plain-text files: ``files[role] = [source file, target file]`` (UTF-8, one sentence
    per line, optionally gzipped), relative to ``root`` unless absolute. ``test`` may be left out."""

    name = "text"

    def __init__(self, src_lang: str, tgt_lang: str, root: Path | None, files: Mapping[str, Sequence[str] | None]):
        super().__init__()
        self.src_lang, self.tgt_lang, self.root = src_lang, tgt_lang, Path(root).expanduser() if root else None
        self.paths: dict[str, dict[str, Path]] = {}
        for role in ("train", "val", "test"):
            pair = files.get(role)
            if pair is None:
                if role != "test":
                    raise FieldError(role, None, "is not set; give [source file, target file]")
                continue
            if isinstance(pair, str) or len(pair) != 2:
                raise FieldError(role, pair, "must be a list of two files: [source, target]")
            paths = [Path(p).expanduser() if self.root is None else self.root / p for p in pair]
            for path in paths:
                if not path.is_file():
                    raise FieldError(role, list(pair), f"names {path}, which is not a file")
            self.paths[role] = dict(zip((src_lang, tgt_lang), paths, strict=True))
        self.roles = {role: (role if role in self.paths else None) for role in ("train", "val", "test")}

    def files(self, split: str, lang: str) -> Path:
        return self.paths[split][lang]


DATASETS = "Hugging Face's datasets library (data=wmt14_*)"  # the extra wmt


class HuggingFaceTranslation(ParallelCorpus):
    """A ``datasets`` translation dataset whose rows are ``{"translation": {lang: text, ...}}`` (the
    layout of the ``wmt14``..``wmt19`` configurations), from the Hub or from a local folder: one written
    by ``DatasetDict.save_to_disk``, or any folder ``datasets.load_dataset`` reads (Parquet, JSON...).
    """

    name = "hf"
    readable_by_workers = True

    def __init__(
        self, src_lang: str, tgt_lang: str, *, path: str, config: str | None, splits: Mapping[str, str | None]
    ) -> None:
        require_installed("datasets", "wmt", DATASETS)  # before the run starts; imported on first use (slow)
        self.src_lang, self.tgt_lang, self.path, self.config = src_lang, tgt_lang, path, config
        self.roles = dict(splits)
        local = Path(path).expanduser()
        self.root = local if local.is_dir() else None  # a local copy, as dataset() tells it from a Hub name
        self._data: Any = None
        self._files: dict[str, list[str]] | None = None  # a worker's: the Arrow files the parent loaded

    def dataset(self) -> Any:
        if self._data is None and self._files is not None:
            datasets = require("datasets", "wmt", DATASETS)

            self._data = {
                split: datasets.concatenate_datasets([datasets.Dataset.from_file(name) for name in names])
                for split, names in self._files.items()
            }
        if self._data is None:
            datasets = require("datasets", "wmt", DATASETS)  # imported on first use: slow, and only WMT needs it

            local = Path(self.path).expanduser()
            try:
                if (local / "dataset_dict.json").is_file():
                    self._data = datasets.load_from_disk(str(local))
                elif local.is_dir():  # data files, split by their names; the Hub's layout: <config>/<split>-*
                    subfolder = self.config if self.config and (local / self.config).is_dir() else None
                    self._data = datasets.load_dataset(str(local), data_dir=subfolder)
                else:
                    self._data = datasets.load_dataset(self.path, self.config)
            except (OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as err:
                raise DataError(
                    f"could not load the dataset {self.path} ({self.config}): {err}; "
                    "without a network, set data.root=<a local copy in the Hugging Face layout>"
                ) from None
            for role, split in self.roles.items():
                if split is not None and split not in self._data:
                    raise DataError(
                        f"dataset {self.path} has no split {split!r} (the {role} split); it has {', '.join(self._data)}"
                    )
            columns = self._data[self.roles["train"]].column_names
            if "translation" not in columns:
                raise DataError(f"dataset {self.path} has no 'translation' column (it has {', '.join(columns)})")
        return self._data

    def fingerprint(self) -> str:
        parts = [self.path, self.config or "", *(self.dataset()[split]._fingerprint for split in self.splits())]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def size(self, split: str) -> int:
        return len(self.dataset()[split])

    def read(self, split: str, rows: np.ndarray | None = None) -> tuple[list[str], list[str]]:
        table = self.dataset()[split]
        if rows is None:
            first, pairs = 0, table["translation"]
        elif len(rows) and rows[-1] - rows[0] == len(rows) - 1:  # a contiguous range: a cheap slice
            first, pairs = int(rows[0]), table[int(rows[0]) : int(rows[-1]) + 1]["translation"]
        else:
            first, pairs = None, table.select(rows)["translation"]
        src, tgt = [], []
        for k, pair in enumerate(pairs):
            s, t = (pair or {}).get(self.src_lang), (pair or {}).get(self.tgt_lang)
            if not isinstance(s, str) or not isinstance(t, str):
                row = first + k if first is not None else int(rows[k])
                raise DataError(
                    f"{self.where(split)} row {row}: no {self.src_lang!r} and {self.tgt_lang!r} text in {pair}"
                )
            src.append(s)
            tgt.append(t)
        return src, tgt

    def where(self, split: str) -> str:
        return f"{self.path} [{split}]"

    def __getstate__(self) -> dict[str, Any]:
        # Workers memory-map the Arrow files the parent loaded: no second resolution, no Hub request.
        state = {**self.__dict__, "_data": None, "_files": self._files}
        if self._data is not None:
            files = {split: [f["filename"] for f in self._data[split].cache_files] for split in self.splits()}
            if all(files.values()):
                state["_files"] = files
        return state
