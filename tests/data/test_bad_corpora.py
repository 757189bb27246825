"""Malformed corpora are reported with file and line before training starts, or filtered with the counts
reported; never a crash in the middle of an epoch."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from aiayn.data import DataError, TextDataModule
from aiayn.errors import FieldError
from helpers.runs import train_in_process

GOOD = [b"a small house", b"the dog runs", b"a cat sits on a mat", b"two dogs play", b"a man walks"] * 4


def corpus(folder: Path, files: dict[str, bytes | None]) -> dict[str, list[str]]:
    """Writes ``<split>.<lang>`` files (default: 20 good lines; None: no file; a ``.gz`` name replaces the
    plain one) and returns the data module's ``train``/``val``/``test`` settings for them."""
    folder.mkdir(parents=True, exist_ok=True)
    settings = {}
    for split in ("train", "val", "test"):
        names = []
        for lang in ("en", "de"):
            name = f"{split}.{lang}.gz" if f"{split}.{lang}.gz" in files else f"{split}.{lang}"
            content = files.get(name, lines(*GOOD))
            if content is not None:
                (folder / name).write_bytes(content)
            names.append(str(folder / name))
        settings[split] = names
    return settings


def prepared(folder: Path, files: dict[str, bytes | None], **options: object) -> TextDataModule:
    options = {"vocab_size": 40, **options}
    dm = TextDataModule(
        src_lang="en", tgt_lang="de", cache_dir=str(folder / "cache"), **corpus(folder, files), **options
    )
    dm.prepare_data()
    dm.setup()
    return dm


def lines(*items: bytes) -> bytes:
    return b"".join(item + b"\n" for item in items)


# (files that differ from a good corpus, module options, the error, what its message must say)
BAD_CORPORA = [
    ({"train.de": lines(*GOOD[:7])}, {}, DataError, r"train\.en has 20 lines but .*train\.de has 7"),
    ({"val.en": lines(*GOOD, b"one more")}, {}, DataError, r"val\.en has 21 lines but .*val\.de has 20"),
    ({"train.en": lines(b"fine", b"caf\xe9 latin-1", *GOOD[2:])}, {}, DataError, r"train\.en:2: invalid UTF-8"),
    ({"test.de": lines(*GOOD[:11], b"\xff\xfe", *GOOD[12:])}, {}, DataError, r"test\.de:12: invalid UTF-8"),
    ({"train.en": b"", "train.de": b""}, {}, DataError, r"train\.en is empty"),
    ({"val.en": b"", "val.de": b""}, {}, DataError, r"val\.en is empty"),
    ({"train.de": None}, {}, FieldError, r"^train=.*train\.de, which is not a file"),
    ({"train.en.gz": gzip.compress(lines(*GOOD))[:30]}, {}, DataError, r"train\.en\.gz: cannot be read"),
    # every training pair is longer than data.max_len: nothing would be left to train on
    ({"train.en": lines(*[b"word " * 60] * 20)}, {"max_len": 32}, DataError, r"train\.en: no training pair left"),
    # a vocabulary with fewer pieces than the corpus has characters
    ({}, {"vocab_size": 12}, FieldError, r"^vocab_size=12 does not suit this corpus: .*than required_chars"),
    # evaluation splits are used whole: a sentence that cannot fit a batch is named before training
    ({"val.de": lines(*GOOD[:3], b"word " * 80, *GOOD[4:])}, {"eval_max_tokens": 64}, DataError,
     r"val\.de:4: this val sentence is \d+ tokens long, more than data\.eval_max_tokens=64"),
]  # fmt: skip


@pytest.mark.parametrize(("files", "options", "error", "message"), BAD_CORPORA)
def test_a_malformed_corpus_is_named_with_file_and_line(
    files: dict[str, bytes | None], options: dict, error: type[Exception], message: str, tmp_path: Path
) -> None:
    with pytest.raises(error, match=message):
        prepared(tmp_path, files, **options)


def test_empty_whitespace_and_overlong_training_lines_are_dropped_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    en = [b"a small house", b"", b"   ", b"the dog runs " * 30, *GOOD[:16]]
    de = [b"ein haus", b"leer", b"auch leer", b"der hund", *GOOD[:16]]
    dm = prepared(tmp_path, {"train.en": lines(*en), "train.de": lines(*de)}, max_len=40)
    assert {key: dm.filtered[key] for key in ("pairs", "kept", "empty", "too_long")} == {
        "pairs": 20, "kept": 17, "empty": 2, "too_long": 1
    }  # fmt: skip
    assert len(dm.datasets["train"]) == 17
    assert "dropped 2 empty, 1 over-long" in caplog.text


def test_empty_evaluation_lines_are_kept_and_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    val = [*GOOD[:5], b"", *GOOD[6:]]
    dm = prepared(tmp_path, {"val.en": lines(*val)})
    assert len(dm.datasets["val"]) == 20 and dm.filtered["val_empty"] == 1
    assert "val: 1 val pair(s) with an empty side, kept (the first: " in caplog.text
    assert "val.en:6" in caplog.text


def test_an_evaluation_sentence_longer_than_learned_positions_stops_the_run_before_training(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Through aiayn-train: the model's check runs in Lightning's setup, before the first step."""
    files = corpus(tmp_path / "c", {"test.en": lines(*GOOD[:8], b"word " * 100, *GOOD[9:])})
    monkeypatch.chdir(tmp_path)
    argv = [
        "data=text", "data.src_lang=en", "data.tgt_lang=de", f"data.cache_dir={cache_dir}", "data.vocab_size=40",
        f"data.train=[{','.join(files['train'])}]", f"data.val=[{','.join(files['val'])}]",
        f"data.test=[{','.join(files['test'])}]", "model=tiny", "model.positional=learned", "model.max_positions=64",
        "data.max_len=64", "logger=none", "progress=quiet",
    ]  # fmt: skip
    assert train_in_process(argv, monkeypatch) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "test.en:9: this test sentence is" in error and "model.max_positions=64" in error
    assert not list((tmp_path / "outputs").glob("*/*/checkpoints/*.ckpt"))  # no step was trained
