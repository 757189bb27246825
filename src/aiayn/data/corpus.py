"""Reading parallel text: the Multi30k files, from a local folder or their public download."""

from __future__ import annotations

import gzip
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

MULTI30K_URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/{stem}.{lang}.gz"
MULTI30K_SPLITS = {"train": "train", "val": "val", "test": "test_2016_flickr"}
MULTI30K_LANGS = ("en", "de", "fr")


class DataError(RuntimeError):
    """Input data that cannot be used as it is; the message names the file (and line)."""


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
    """UTF-8 lines without their line ends; invalid UTF-8 is reported with file and line."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        raw = handle.read()
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    text = []
    for number, line in enumerate(lines, start=1):
        try:
            text.append(line.decode("utf-8").rstrip("\r"))
        except UnicodeDecodeError as err:
            raise DataError(f"{path}:{number}: invalid UTF-8 ({err.reason} at byte {err.start})") from None
    return text


def read_parallel(src_path: Path, tgt_path: Path) -> tuple[list[str], list[str]]:
    """Aligned source and target lines; files of different lengths are an error, not a silent cut."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}; the files must be aligned")
    if not src:
        raise DataError(f"{src_path} is empty")
    return src, tgt


def download_multi30k(target: Path, langs: tuple[str, ...]) -> Path:
    """Fetch the Multi30k task-1 files of ``langs`` into ``target`` (once), atomically per file."""
    target.mkdir(parents=True, exist_ok=True)
    for stem in MULTI30K_SPLITS.values():
        for lang in langs:
            path = target / f"{stem}.{lang}.gz"
            if path.is_file():
                continue
            url = MULTI30K_URL.format(stem=stem, lang=lang)
            partial = path.with_name(path.name + ".part")
            try:
                with urllib.request.urlopen(url, timeout=60) as response, open(partial, "wb") as out:
                    shutil.copyfileobj(response, out)
                os.replace(partial, path)
            except (urllib.error.URLError, OSError) as err:
                partial.unlink(missing_ok=True)
                raise DataError(
                    f"could not download Multi30k from {url} ({err}); "
                    "download the task-1 raw files yourself and set data.root=<folder>"
                ) from None
    return target
