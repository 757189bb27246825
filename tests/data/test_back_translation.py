"""Back-translation: extra training pairs mixed with the real corpus, tagged with one reserved BPE piece or with
the real corpus upsampled (aiayn.data.back_translation), and the whole recipe through the console scripts."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from aiayn.config.build import config_keys
from aiayn.data import DataError, Multi30kDataModule, TextDataModule, TokenBudgetBatchSampler
from aiayn.data.back_translation import TAG, TrainingMix, misplaced
from aiayn.data.dataset import EncodedText
from aiayn.data.stored import instantiated_from_checkpoint
from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import ConfigError
from assets.make_corpus import sentence
from helpers.runs import SMOKE_RUN_EXTRA, exit_status, smoke_run, train_in_process

SYNTHETIC = 60  # extra pairs of the fast tests; one of them has an empty source
EMPTY_ROW = 7


def write(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def extra_root(corpus_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``synthetic.en`` and ``mono.de``: 60 pairs from the end of the corpus's training split, reversed, one
    with an empty (failed) translation."""
    folder = tmp_path_factory.mktemp("extra")
    en = (corpus_root / "train.en").read_text(encoding="utf-8").splitlines()[::-1][:SYNTHETIC]
    de = (corpus_root / "train.de").read_text(encoding="utf-8").splitlines()[::-1][:SYNTHETIC]
    en[EMPTY_ROW] = ""
    write(folder / "synthetic.en", en)
    write(folder / "mono.de", de)
    return folder


def module(corpus_root: Path, cache: Path, **options: object) -> Multi30kDataModule:
    return Multi30kDataModule(root=str(corpus_root), cache_dir=str(cache), vocab_size=1000, **options)


@pytest.fixture(scope="module")
def tagged(corpus_root: Path, extra_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Multi30kDataModule:
    """Multi30k en→de (the small corpus) with the extra pairs tagged and the real pairs upsampled 3 times."""
    extra = [[str(extra_root / "synthetic.en"), str(extra_root / "mono.de")]]
    dm = module(corpus_root, tmp_path_factory.mktemp("cache"), extra_train=extra, tag_extra=True, upsample_primary=3)
    dm.prepare_data()
    dm.setup()
    return dm


def test_the_tag_is_one_reserved_piece_of_the_bpe_model(tagged: Multi30kDataModule) -> None:
    tokenizer = tagged.tokenizer
    tag = tokenizer.sp.piece_to_id(TAG)
    assert (tag, tokenizer.sp.id_to_piece(tag), tokenizer.vocab_size) == (4, TAG, 1000)  # after pad, unk, bos, eos
    pieces = tokenizer.sp.encode(["a<BT>b", "x <BT> y", "<BT"], out_type=str)
    assert [row.count(TAG) for row in pieces] == [1, 1, 0]  # never split, never made of other text


def test_the_tag_starts_exactly_the_extra_sources(tagged: Multi30kDataModule) -> None:
    folder, tag = tagged.cache_folder(), tagged.tokenizer.sp.piece_to_id(TAG)
    extra = EncodedText.load(folder / "extra1.en")
    starts = [len(row) > 0 and row[0] == tag for row in map(extra.__getitem__, range(len(extra)))]
    assert sum(starts) == SYNTHETIC - 1 and not starts[EMPTY_ROW]  # an empty source stays empty: dropped
    assert misplaced(extra, tag, leading=True) is None  # nowhere but at the start
    for stem in ("train.en", "train.de", "val.en", "val.de", "test.en", "test.de", "extra1.de"):
        assert misplaced(EncodedText.load(folder / stem), tag, leading=False) is None, stem
    for loader in (tagged.val_dataloader(), tagged.test_dataloader()):  # the batches evaluation translates
        assert all(not (batch["src"] == tag).any() for batch in loader)
    mix = tagged.datasets["train"]
    sources = [mix[i][1] for i in range(len(mix))]
    assert sum(int(src[0] == tag) for src in sources) == SYNTHETIC - 1 == tagged.filtered["extra_kept"]
    assert sum(int((src[1:] == tag).sum()) for src in sources) == 0
    assert all(not (mix[i][2] == tag).any() for i in range(len(mix)))  # no target teaches the model to write it


def test_the_real_pairs_are_repeated_upsample_primary_times(tagged: Multi30kDataModule) -> None:
    counts = tagged.filtered
    assert (counts["kept"], counts["extra_pairs"], counts["extra_kept"], counts["extra_empty"]) == (500, 60, 59, 1)
    assert counts["epoch_pairs"] == len(tagged.datasets["train"]) == 500 * 3 + 59
    sampler = TokenBudgetBatchSampler(tagged.datasets["train"].padded_lengths(), 800, seed=1)
    drawn = Counter(i for batch in sampler for i in batch)
    assert sorted(drawn) == list(range(1559)) and set(drawn.values()) == {1}  # one epoch: every pair once
    real = Counter(tagged.datasets["train"].parts[0].indices.tolist())
    assert len(real) == 500 and set(real.values()) == {3}  # each real pair three times


def test_the_mix_is_sharded_and_resumed_as_one_split(tagged: Multi30kDataModule) -> None:
    lengths = tagged.datasets["train"].padded_lengths()
    ranks = [TokenBudgetBatchSampler(lengths, 800, seed=1, num_replicas=2, rank=r) for r in (0, 1)]
    for sampler in ranks:
        sampler.set_epoch(3)
    batches = [list(sampler) for sampler in ranks]
    owned = [{i for batch in rank for i in batch} for rank in batches]
    assert len(batches[0]) == len(batches[1]) and not owned[0] & owned[1]
    resumed = TokenBudgetBatchSampler(lengths, 800, seed=1, num_replicas=2, rank=0)
    resumed.load_state_dict(ranks[0].state_dict(consumed=5))
    assert list(resumed) == batches[0][5:]
    assert ranks[0].state_dict(0)["pairs"] == 1559  # another upsampling is another layout: the epoch restarts


def test_the_mix_indexes_its_parts_one_after_the_other(tagged: Multi30kDataModule) -> None:
    mix = tagged.datasets["train"]
    assert isinstance(mix, TrainingMix) and [len(part) for part in mix.parts] == [1500, 59]
    real, extra = mix.parts
    assert mix[1499][0] == 1499 and np.array_equal(mix[1499][1], real[1499][1])
    assert mix[1500][0] == 1500 and np.array_equal(mix[1500][2], extra[0][2])


def test_the_cache_key_follows_the_extra_pairs_and_the_tag(corpus_root: Path, extra_root: Path, tmp_path: Path) -> None:
    pair = [[str(extra_root / "synthetic.en"), str(extra_root / "mono.de")]]

    def name(**options: object) -> str:
        return module(corpus_root, tmp_path, **options).cache_folder().name

    plain, untagged, tagged = name(), name(extra_train=pair), name(extra_train=pair, tag_extra=True)
    assert name(extra_train=[]) == plain  # runs without extra pairs keep their caches
    assert len({plain, untagged, tagged}) == 3
    changed = tmp_path / "changed"
    write(changed / "synthetic.en", (extra_root / "synthetic.en").read_text().splitlines()[::-1])
    write(changed / "mono.de", (extra_root / "mono.de").read_text().splitlines()[::-1])
    assert name(extra_train=[[str(changed / "synthetic.en"), str(changed / "mono.de")]]) != untagged
    # upsampling changes no cached id: the cache (and the tokenizer) stay; resume refuses it as any data.* change
    assert name(extra_train=pair, upsample_primary=4) == untagged


def test_extra_files_are_relative_to_the_root(tmp_path: Path) -> None:
    good = [f"word{i} and word{i + 1}" for i in range(20)]
    for name in ("train.en", "train.de", "val.en", "val.de", "synthetic.en", "mono.de"):
        write(tmp_path / "c" / name, good)
    dm = TextDataModule("en", "de", ["train.en", "train.de"], ["val.en", "val.de"], root=str(tmp_path / "c"),
                        extra_train=[["synthetic.en", "mono.de"]], cache_dir=str(tmp_path / "cache"))  # fmt: skip
    assert dm.extra is not None and dm.extra.files("extra1", "en") == tmp_path / "c" / "synthetic.en"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"extra_train": "synthetic.en"}, r"data\.extra_train=synthetic\.en must be a list of \[source file, target"),
        ({"extra_train": ["synthetic.en", "mono.de"]}, r"data\.extra_train=.* must be a list of \[source file, target"),
        ({"extra_train": [["synthetic.en"]]}, r"must be a list of \[source file, target file\] pairs"),
        ({"extra_train": [["synthetic.en", ""]]}, r"data\.extra_train=.* must name two files"),
        ({"extra_train": [["nowhere.en", "mono.de"]]}, r"data\.extra_train=.* names .*nowhere\.en, which is not a"),
        ({"tag_extra": "yes"}, r"data\.tag_extra=yes must be true or false"),
        ({"tag_extra": True}, r"data\.tag_extra=true tags the sources of data\.extra_train, which is empty"),
        ({"upsample_primary": 0}, r"data\.upsample_primary=0 must be a whole number >= 1"),
        ({"upsample_primary": 1.5}, r"data\.upsample_primary=1\.5 must be a whole number >= 1"),
        ({"upsample_primary": 2}, r"data\.upsample_primary=2 repeats the real pairs against those of data\.extra"),
    ],
)
def test_bad_settings_are_refused_in_one_line(
    options: dict[str, object], message: str, extra_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(extra_root)  # data.root=null (a download): relative names are the working folder's
    with pytest.raises(ConfigError, match=message) as refused, config_keys("data"):  # as aiayn-train names it
        Multi30kDataModule(root=None, cache_dir=str(tmp_path), **options)
    assert "\n" not in str(refused.value)


def test_aiayn_train_refuses_a_bad_setting_before_any_work(
    corpus_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    argv = [*smoke_run(corpus_root, tmp_path / "cache"), "data.upsample_primary=0", f"hydra.run.dir={tmp_path / 'run'}"]
    assert train_in_process(argv, monkeypatch) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith("data.upsample_primary=0 must be a whole number >= 1")
    assert not (tmp_path / "cache").exists()


# (the file and the line that hold the tag, what the message names)
TAG_IN_TEXT = [
    ("val.en", 3, r"val\.en:3: holds <BT>, which data\.tag_extra=true reserves"),
    ("train.de", 5, r"train\.de:5: holds <BT>"),
    ("mono.de", 2, r"mono\.de:2: holds <BT>"),
    ("synthetic.en", 1, r"synthetic\.en:1: holds <BT>"),  # a second one after the tag the mix puts in front
]


@pytest.mark.parametrize(("name", "line", "message"), TAG_IN_TEXT)
def test_the_tag_in_any_text_is_refused_with_file_and_line(name: str, line: int, message: str, tmp_path: Path) -> None:
    good = [f"a small house number {i}" for i in range(20)]
    for stem in ("train.en", "train.de", "val.en", "val.de", "synthetic.en", "mono.de"):
        write(tmp_path / stem, [f"<BT> {text}" if stem == name and row == line else text
                                for row, text in enumerate(good, start=1)])  # fmt: skip
    dm = TextDataModule("en", "de", ["train.en", "train.de"], ["val.en", "val.de"], root=str(tmp_path),
                        extra_train=[["synthetic.en", "mono.de"]], tag_extra=True, vocab_size=60,
                        cache_dir=str(tmp_path / "cache"))  # fmt: skip
    with pytest.raises(DataError, match=message):
        dm.prepare_data()


def test_evaluation_of_a_stored_run_needs_none_of_its_extra_files(corpus_root: Path, tmp_path: Path) -> None:
    stored = {
        "_target_": "aiayn.data.Multi30kDataModule", "src_lang": "en", "tgt_lang": "de", "root": "/theirs",
        "vocab_size": 1000, "extra_train": [["/theirs/synthetic.en", "mono.de"]], "tag_extra": True,
        "upsample_primary": 4,
    }  # fmt: skip
    dm = instantiated_from_checkpoint(stored, "data", tmp_path / "config.yaml", root=corpus_root)
    assert dm.extra is None and len(dm.split_texts("test")[0]) == 100


@pytest.mark.slow
def test_the_back_translation_recipe(
    corpus_root: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/decoding.md's three commands, each a console script's main in this process: a reverse (de→en)
    smoke model, 300 monolingual German lines translated with sampling, a forward run on the mix."""
    from aiayn.cli import translate as translate_cli

    reverse, forward = tmp_path / "reverse", tmp_path / "forward"
    assert train_in_process([*smoke_run(corpus_root, cache_dir, *SMOKE_RUN_EXTRA), "data=multi30k_de_en",
                             f"hydra.run.dir={reverse}"], monkeypatch) == 0  # fmt: skip
    rng = random.Random(2018)
    mono = write(tmp_path / "mono.de", [sentence(rng)[1] for _ in range(300)])  # German the corpus does not hold
    synthetic = tmp_path / "synthetic.en"
    checkpoint = f"checkpoint={reverse}/checkpoints/best.ckpt"
    sample = [f"input={mono}", f"output={synthetic}", "decoding=sample", "seed=1"]
    assert exit_status(translate_cli.main, ["aiayn-translate", checkpoint, *sample], monkeypatch) == 0
    assert len(synthetic.read_text(encoding="utf-8").splitlines()) == 300

    mix = [f"data.extra_train=[[{synthetic},{mono}]]", "data.tag_extra=true", "data.upsample_primary=2"]
    argv = [*smoke_run(corpus_root, cache_dir, *SMOKE_RUN_EXTRA), *mix, f"hydra.run.dir={forward}"]
    assert train_in_process(argv, monkeypatch) == 0
    results = json.loads((forward / "results.json").read_text())
    data = results["data"]
    assert results["steps"] == 12 and data["kept"] == 400 and data["extra_pairs"] == 300  # debug=smoke: 400 real
    dropped = data["extra_empty"] + data["extra_too_long"] + data["extra_length_ratio"]  # 9 empty translations
    assert data["epoch_pairs"] == 400 * 2 + data["extra_kept"] and data["extra_kept"] == 300 - dropped > 250
    folder = cache_dir / "tokenized" / results["data_cache"]
    tag = Tokenizer(folder / "spm.model").sp.piece_to_id(TAG)
    assert tag == 4
    extra = EncodedText.load(folder / "extra1.en")
    tagged = [i for i in range(len(extra)) if len(extra[i]) and extra[i][0] == tag]
    assert len(tagged) == 300 - data["extra_empty"] and misplaced(extra, tag, leading=True) is None
    for stem in ("train.en", "val.en", "test.en", "train.de", "extra1.de"):
        assert misplaced(EncodedText.load(folder / stem), tag, leading=False) is None, stem
