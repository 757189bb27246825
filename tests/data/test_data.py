"""The Multi30k data module: caching, batches, and clear errors on bad input."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch

from aiayn.config.build import config_keys
from aiayn.data import DataError, Multi30kDataModule, Tokenizer
from aiayn.data import corpus as corpus_module
from aiayn.errors import FieldError


def datamodule(root: Path, cache: Path, **kwargs: object) -> Multi30kDataModule:
    dm = Multi30kDataModule(root=str(root), cache_dir=str(cache), vocab_size=1000, **kwargs)
    dm.prepare_data()
    dm.setup()
    return dm


def test_tokenizer_and_encoded_splits_are_cached(corpus_root: Path, cache_dir: Path) -> None:
    first = datamodule(corpus_root, cache_dir)
    # The cache is the session's, shared by the test processes: another one's file being written (a
    # hidden temporary, renamed into place when whole) is not this test's.
    cached = sorted(p for p in first.tokenizer.model_file.parent.iterdir() if not p.name.startswith("."))
    stamps = {p: p.stat().st_mtime_ns for p in cached}
    second = datamodule(corpus_root, cache_dir, src_lang="de", tgt_lang="en")  # same pair, other way
    assert second.tokenizer.model_file == first.tokenizer.model_file
    assert {p: p.stat().st_mtime_ns for p in cached} == stamps  # nothing trained or encoded again
    assert second.tokenizer.vocab_size == 1000
    assert len(first.datasets["train"]) == 500 and len(first.references["test"]) == 100


def test_batches_are_teacher_forcing_pairs(corpus_root: Path, cache_dir: Path) -> None:
    dm = datamodule(corpus_root, cache_dir, max_tokens=800)
    tok: Tokenizer = dm.tokenizer
    batch = next(iter(dm.val_dataloader()))
    src, tgt_in, tgt_out = batch["src"], batch["tgt_in"], batch["tgt_out"]
    assert src.numel() <= 800 and tgt_in.numel() <= 800
    assert (tgt_in[:, 0] == tok.bos_id).all()
    torch.testing.assert_close(tgt_in[:, 1:], tgt_out[:, :-1].masked_fill(tgt_out[:, :-1] == tok.eos_id, 0))
    assert (src.eq(tok.eos_id).sum(1) == 1).all() and (tgt_out.eq(tok.eos_id).sum(1) == 1).all()
    real = torch.stack([src.ne(tok.pad_id).sum(1), tgt_out.ne(tok.pad_id).sum(1)], dim=1)
    assert batch["lengths"].tolist() == real.tolist()  # the real token counts, on the CPU
    # the flat positions of exactly those target tokens, in order
    assert batch["target_rows"].tolist() == tgt_out.flatten().ne(tok.pad_id).nonzero().flatten().tolist()
    first = batch["index"][0].item()
    ids = tgt_out[0][tgt_out[0] > tok.eos_id].tolist()
    assert tok.decode([ids])[0] == dm.references["val"][first] == batch["references"][0]


def test_detokenized_text_round_trips(corpus_root: Path, cache_dir: Path) -> None:
    dm = datamodule(corpus_root, cache_dir)
    refs = dm.references["test"][:200]
    assert dm.tokenizer.decode(dm.tokenizer.encode(refs)) == refs


def write_corpus(root: Path, lines: dict[str, list[bytes]]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for stem in ("train", "val", "test_2016_flickr"):
        for lang, content in lines.items():
            with gzip.open(root / f"{stem}.{lang}.gz", "wb") as f:
                f.write(b"".join(line + b"\n" for line in content))


def test_misaligned_files_name_both_files(tmp_path: Path) -> None:
    write_corpus(tmp_path / "c", {"en": [b"a b", b"c d", b"e"], "de": [b"x y", b"z"]})
    dm = Multi30kDataModule(root=str(tmp_path / "c"), cache_dir=str(tmp_path / "cache"), vocab_size=20)
    with pytest.raises(DataError, match=r"train\.en\.gz has 3 lines but .*train\.de\.gz has 2"):
        dm.prepare_data()


def test_invalid_utf8_names_file_and_line(tmp_path: Path) -> None:
    write_corpus(tmp_path / "c", {"en": [b"fine", b"also fine", b"bad \xff byte"], "de": [b"a", b"b", b"c"]})
    dm = Multi30kDataModule(root=str(tmp_path / "c"), cache_dir=str(tmp_path / "cache"), vocab_size=20)
    with pytest.raises(DataError, match=r"train\.en\.gz:3: invalid UTF-8"):
        dm.prepare_data()


def test_missing_root_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(FieldError, match=r"^root=.*nowhere is not a folder"):
        Multi30kDataModule(root=str(tmp_path / "nowhere"), cache_dir=str(tmp_path))


def test_a_root_without_a_needed_file_names_the_file(tmp_path: Path) -> None:
    write_corpus(tmp_path / "c", {"en": [b"a"], "fr": [b"b"]})  # no German
    with pytest.raises(DataError, match=r"train\.de\.gz not found"):
        Multi30kDataModule(root=str(tmp_path / "c"), cache_dir=str(tmp_path / "cache"))


def test_impossible_download_says_to_set_data_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Port 9 on loopback refuses the connection at once: the real download code, failing for real.
    monkeypatch.setattr(corpus_module, "MULTI30K_URL", "http://127.0.0.1:9/{stem}.{lang}.gz")
    dm = Multi30kDataModule(root=None, cache_dir=str(tmp_path))
    with pytest.raises(DataError, match=r"set data\.root="):
        dm.prepare_data()
    assert not list((tmp_path / "multi30k").iterdir())  # no partial file left behind


def test_download_fills_the_cache_from_the_public_layout(
    corpus_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The download path, served from a local copy through file:// URLs in the public (gzipped) layout."""
    served = tmp_path / "served"
    served.mkdir()
    for plain in corpus_root.iterdir():
        (served / f"{plain.name}.gz").write_bytes(gzip.compress(plain.read_bytes(), mtime=0))
    monkeypatch.setattr(corpus_module, "MULTI30K_URL", served.as_uri() + "/{stem}.{lang}.gz")
    dm = Multi30kDataModule(root=None, cache_dir=str(tmp_path), vocab_size=500, train_limit=100)
    dm.prepare_data()
    dm.setup()
    assert (tmp_path / "multi30k" / "train.fr.gz").read_bytes() == (served / "train.fr.gz").read_bytes()
    assert len(dm.datasets["train"]) == 100


def test_empty_and_overlong_training_pairs_are_dropped_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    en = [b"a small house", b"", b"the dog runs " * 30, b"a cat sits", b"two dogs"] * 4
    de = [b"ein kleines haus", b"leer", b"der hund rennt", b"eine katze sitzt", b"zwei hunde"] * 4
    write_corpus(tmp_path / "c", {"en": en, "de": de})
    dm = Multi30kDataModule(root=str(tmp_path / "c"), cache_dir=str(tmp_path / "cache"), vocab_size=40, max_len=40)
    dm.prepare_data()
    dm.setup()
    assert len(dm.datasets["train"]) == 12
    assert "dropped 4 empty, 4 over-long" in caplog.text
    assert len(dm.datasets["val"]) == 20  # evaluation splits are never filtered


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"src_lang": "en", "tgt_lang": "en"}, "data.tgt_lang=en is data.src_lang too"),
        ({"src_lang": "xx"}, "data.src_lang=xx is not a language of Multi30k"),
        ({"val_split": "dev"}, "data.val_split=dev must be one of"),
    ],
)
def test_bad_settings_are_rejected_early(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message), config_keys("data"):  # as aiayn-train names it
        Multi30kDataModule(**kwargs)
