"""A corpus's fingerprint names its cache: corpora of other content must never share one."""

from __future__ import annotations

from pathlib import Path

from aiayn.data.corpus import TextFiles, file_digest


def written(folder: Path, files: dict[str, str]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return [folder / name for name in files]


def test_file_boundaries_are_part_of_the_digest(tmp_path: Path) -> None:
    ab_c = written(tmp_path / "one", {"x": "ab", "y": "c"})
    a_bc = written(tmp_path / "two", {"x": "a", "y": "bc"})
    assert file_digest(ab_c) != file_digest(a_bc)
    assert file_digest(written(tmp_path / "copy", {"p": "ab", "q": "c"})) == file_digest(ab_c)  # content, not names


def test_corpora_whose_files_join_alike_have_their_own_caches(tmp_path: Path) -> None:
    """A sentence moved from the end of train.de to the start of train.en (the files are read in that
    order): the files joined are the same bytes, the corpora are not."""
    first = {"train.de": "ein mann\nder hund\n", "train.en": "a man\nthe dog\n", "val.en": "a cat\n"}
    moved = {"train.de": "ein mann\n", "train.en": "der hund\na man\nthe dog\n", "val.en": "a cat\n"}
    fingerprints = []
    for name, files in (("first", first), ("moved", moved)):
        written(tmp_path / name, {**files, "val.de": "eine katze\n"})
        pairs = {"train": ["train.en", "train.de"], "val": ["val.en", "val.de"]}
        fingerprints.append(TextFiles("en", "de", tmp_path / name, pairs).fingerprint())
    assert fingerprints[0] != fingerprints[1]
