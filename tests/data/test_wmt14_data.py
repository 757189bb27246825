"""WMT14 through Hugging Face ``datasets`` and plain parallel text: loading, caching, filtering, errors.

The datasets are small local copies in the Hugging Face layout (the ``translation`` column of the
``wmt14`` configurations), written by the tests from Multi30k sentences.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import sacrebleu

from aiayn.config.build import config_keys
from aiayn.config.compose import compose_run_config
from aiayn.data import DataError, TextDataModule, WMT14DataModule, encoding
from aiayn.data.corpus import read_lines
from aiayn.evaluation.translator import Translator
from aiayn.experiments.run import train
from aiayn.model import DecodingOptions
from aiayn.training.checkpoints import load_model
from helpers.extras import dev_extra

datasets = dev_extra("datasets")  # the wmt extra (Hugging Face datasets)


@pytest.fixture(scope="module")
def sentences(corpus_root: Path) -> dict[str, list[str]]:
    return {lang: read_lines(corpus_root / f"train.{lang}")[:400] for lang in ("en", "de")}


def translation_rows(en: list[str], de: list[str]) -> dict[str, list[dict[str, str]]]:
    return {"translation": [{"de": d, "en": e} for e, d in zip(en, de, strict=True)]}


def wmt_like(sentences: dict[str, list[str]]) -> datasets.DatasetDict:
    en, de = sentences["en"][:300], sentences["de"][:300]
    # 3 empty, 2 over-long and 2 length-mismatched pairs among 300
    en[10] = ""
    de[20] = ""
    en[30] = de[30] = ""
    for row in (40, 50):  # thirty sentences in one line, on both sides
        en[row], de[row] = " ".join(sentences["en"][100:130]), " ".join(sentences["de"][100:130])
    de[60] = de[60] + " " + " ".join(["und noch ein sehr langer Nachsatz"] * 4)
    en[70] = "Yes."
    de[70] = sentences["de"][70] + " " + sentences["de"][71]
    splits = {"train": (en, de), "validation": (sentences["en"][300:340], sentences["de"][300:340])}
    splits["test"] = (sentences["en"][340:400], sentences["de"][340:400])
    return datasets.DatasetDict({name: datasets.Dataset.from_dict(translation_rows(*p)) for name, p in splits.items()})


def module(root: Path, cache: Path, **options: object) -> WMT14DataModule:
    options = {"vocab_size": 300, "max_len": 200, "max_len_ratio": 2.0, **options}
    return WMT14DataModule(root=str(root), cache_dir=str(cache), config="de-en", **options)


def test_a_local_wmt14_copy_is_encoded_in_parallel_cached_and_filtered(
    sentences: dict[str, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wmt_like(sentences).save_to_disk(str(tmp_path / "wmt14"))
    monkeypatch.setattr(encoding, "CHUNK_PAIRS", 64)  # 5 chunks of the training split over 2 processes
    dm = module(tmp_path / "wmt14", tmp_path / "cache", encode_workers=2, tokenizer_sample=200)
    dm.prepare_data()
    dm.setup()
    expected = {
        "pairs": 300,
        "kept": 293,
        "empty": 3,
        "too_long": 2,
        "length_ratio": 2,
        "val_empty": 0,
        "test_empty": 0,
    }
    assert dm.filtered == expected
    assert len(dm.datasets["train"]) == 293 and len(dm.references["val"]) == 40 and len(dm.references["test"]) == 60
    assert dm.references["test"][0] == sentences["de"][340]  # newstest2014's place: the German side

    # the chunks were encoded in order: ids decode to the corpus's own sentences
    folder = dm.cache_folder()
    train_de = dm.datasets["train"].tgt
    assert train_de.tokens.dtype == np.uint16 and isinstance(train_de.tokens, np.memmap)
    german = [pair["de"] for pair in wmt_like(sentences)["train"]["translation"]]
    for row in (0, 64, 299):
        assert dm.tokenizer.decode([train_de[row].tolist()])[0] == german[row]

    # a restart (or another rank, or the other direction) reuses every cached file
    stamps = {path: path.stat().st_mtime_ns for path in folder.iterdir()}
    again = module(tmp_path / "wmt14", tmp_path / "cache", src_lang="de", tgt_lang="en", tokenizer_sample=200)
    again.prepare_data()
    again.setup()
    assert again.cache_folder() == folder and {p: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps
    assert again.references["val"][0] == sentences["en"][300]


def test_parquet_files_in_the_hub_layout_load_too(sentences: dict[str, list[str]], tmp_path: Path) -> None:
    root = tmp_path / "wmt14-parquet"
    (root / "de-en").mkdir(parents=True)
    for name, split in wmt_like(sentences).items():
        split.to_parquet(str(root / "de-en" / f"{name}-00000-of-00001.parquet"))
    dm = module(root, tmp_path / "cache", encode_workers=1)
    dm.prepare_data()
    dm.setup()
    assert dm.filtered["kept"] == 293 and dm.tokenizer.vocab_size == 300


def test_a_row_without_both_languages_names_split_and_row(sentences: dict[str, list[str]], tmp_path: Path) -> None:
    data = wmt_like(sentences)
    rows = data["validation"].to_dict()["translation"]
    rows[7] = {"de": "nur Deutsch", "fr": "seulement"}
    data["validation"] = datasets.Dataset.from_dict({"translation": rows})
    data.save_to_disk(str(tmp_path / "broken"))
    with pytest.raises(DataError, match=r"\[validation\] row 7: no 'en' and 'de' text"):
        module(tmp_path / "broken", tmp_path / "cache").prepare_data()


def test_missing_split_and_unknown_pair_are_clear_errors(sentences: dict[str, list[str]], tmp_path: Path) -> None:
    data = wmt_like(sentences)
    del data["test"]
    data.save_to_disk(str(tmp_path / "no-test"))
    with pytest.raises(DataError, match=r"no split 'test' \(the test split\); it has train, validation"):
        module(tmp_path / "no-test", tmp_path / "cache").prepare_data()
    unknown_pair = r"data\.config=fr-en does not hold data\.src_lang=en and data\.tgt_lang=de"
    with pytest.raises(ValueError, match=unknown_pair), config_keys("data"):  # as aiayn-train names it
        WMT14DataModule(config="fr-en")


def test_any_two_aligned_files_are_a_corpus(
    sentences: dict[str, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, rows in (("train", slice(0, 300)), ("dev", slice(300, 340))):
        (tmp_path / f"{name}.en").write_text("".join(line + "\n" for line in sentences["en"][rows]))
        (tmp_path / f"{name}.de").write_text("".join(line + "\n" for line in sentences["de"][rows]))
    monkeypatch.setattr(encoding, "CHUNK_PAIRS", 64)  # text is sent to 2 worker processes chunk by chunk
    dm = TextDataModule(
        "en", "de", train=["train.en", "train.de"], val=["dev.en", "dev.de"], root=str(tmp_path),
        cache_dir=str(tmp_path / "cache"), vocab_size=300, encode_workers=2,
    )  # fmt: skip
    dm.prepare_data()
    dm.setup()
    assert dm.roles == ["train", "val"] and len(dm.datasets["train"]) == 300
    train_en = dm.datasets["train"].src
    assert [dm.tokenizer.decode([train_en[row].tolist()])[0] for row in (0, 130, 299)] == [
        sentences["en"][row] for row in (0, 130, 299)
    ]

    # a lost tokenizer is trained again, and the ids of the old one are not reused
    (dm.cache_folder() / "spm.model").unlink()
    stamp = (dm.cache_folder() / "train.en.offsets.npy").stat().st_mtime_ns
    again = TextDataModule(
        "en", "de", train=["train.en", "train.de"], val=["dev.en", "dev.de"], root=str(tmp_path),
        cache_dir=str(tmp_path / "cache"), vocab_size=300,
    )  # fmt: skip
    again.prepare_data()
    assert (again.cache_folder() / "train.en.offsets.npy").stat().st_mtime_ns != stamp
    assert dm.split_texts("val") == (sentences["en"][300:340], sentences["de"][300:340])
    (tmp_path / "dev.de").write_text("eins\nzwei\n")
    with pytest.raises(DataError, match=r"dev\.en has 40 lines but .*dev\.de has 2"):
        TextDataModule("en", "de", train=["train.en", "train.de"], val=["dev.en", "dev.de"], root=str(tmp_path),
                       cache_dir=str(tmp_path / "cache"), vocab_size=300).prepare_data()  # fmt: skip


@pytest.mark.slow
def test_a_corpus_without_a_test_split_trains_and_reports_validation_scores(
    sentences: dict[str, list[str]], tmp_path: Path
) -> None:
    for name, rows in (("train", slice(0, 300)), ("dev", slice(300, 340))):
        for lang in ("en", "de"):
            (tmp_path / f"{name}.{lang}").write_text("".join(line + "\n" for line in sentences[lang][rows]))
    overrides = [
        "data=text", f"data.root={tmp_path}", "data.src_lang=en", "data.tgt_lang=de", "data.train=[train.en,train.de]",
        "data.val=[dev.en,dev.de]", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=300", "model=tiny",
        "logger=none", "progress=quiet", "decoding=greedy", "trainer.max_steps=3", "dashboard.attention_every=0",
    ]  # fmt: skip
    results = train(compose_run_config(overrides), tmp_path / "run", overrides)
    assert results["steps"] == 3 and "test_bleu" not in results
    assert not (tmp_path / "run" / "test.hyp.txt").exists()
    # the default's EMA is validated all the same, so that the answer is still chosen by validation
    answer = "ema" if results["val_bleu_ema"] > results["val_bleu"] else "best"
    assert results["answer"] == answer and results["answer_test_bleu"] is None
    # val_bleu is the corpus BLEU (13a, cased; no smoothing, as torchmetrics computes it during training)
    # of the evaluated checkpoint's greedy translations of dev.en, recomputed here with sacreBLEU itself
    model, tokenizer, _ = load_model(tmp_path / "run" / results["evaluated_checkpoint"])
    greedy = DecodingOptions(beam_size=1, alpha=0.0)  # decoding=greedy
    hypotheses = Translator(model, tokenizer, greedy).translate(sentences["en"][300:340])
    bleu = sacrebleu.BLEU(smooth_method="none").corpus_score(hypotheses, [sentences["de"][300:340]])
    assert results["val_bleu"] == pytest.approx(bleu.score, abs=1e-3)
