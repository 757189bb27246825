"""BPE-dropout while training (data.bpe_dropout, aiayn.data.bpe_dropout): every epoch draws the training pairs
in another segmentation of the same text, from the seed and the epoch alone (in any process); evaluation pairs
keep theirs; a run resumed mid-epoch trains on the batches of an uninterrupted one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl

from aiayn.config.compose import compose_run_config
from aiayn.data import Multi30kDataModule, TokenBudgetBatchSampler
from aiayn.data import bpe_dropout as bpe_dropout_module
from aiayn.data.back_translation import TAG
from aiayn.data.bpe_dropout import BpeDropout, EpochSegmentation
from aiayn.data.dataset import EncodedText, ParallelDataset
from aiayn.data.stored import instantiated_from_checkpoint
from aiayn.experiments.run import train
from helpers.runs import refusal, resumable_run, smoke_run


def module(root: Path, cache: Path, **options: Any) -> Multi30kDataModule:
    dm = Multi30kDataModule(root=str(root), cache_dir=str(cache), vocab_size=1000, **options)
    dm.prepare_data()
    dm.setup()
    return dm


def drawn(dm: Multi30kDataModule, epoch: int, workers: int = 1) -> ParallelDataset:
    segmentation = dm.datasets["train"]
    assert isinstance(segmentation, EpochSegmentation)
    segmentation.draw(epoch, workers)
    return segmentation.pairs


def rows(text: EncodedText) -> list[list[int]]:
    return [text[i].tolist() for i in range(len(text))]


def test_without_dropout_the_segmentation_is_sentencepieces(corpus_root: Path, cache_dir: Path) -> None:
    dm = module(corpus_root, cache_dir)
    fixed, bpe = dm.datasets["train"], BpeDropout(dm.tokenizer, 0.0)
    for text in (fixed.src, fixed.tgt):
        assert bpe.sentences(text, np.random.default_rng(0)) == rows(text)


def test_training_ids_differ_between_epochs_but_decode_to_the_same_text(corpus_root: Path, cache_dir: Path) -> None:
    dm = module(corpus_root, cache_dir, bpe_dropout=0.1)
    fixed = module(corpus_root, cache_dir).datasets["train"]
    first, second = drawn(dm, 0), drawn(dm, 1)
    src, tgt = dm.corpus.read("train", fixed.indices)
    assert len(first) == len(second) == len(fixed) == 500
    for epoch in (first, second):
        assert dm.tokenizer.decode(rows(epoch.src)) == src
        assert dm.tokenizer.decode(rows(epoch.tgt)) == tgt
    changed = [a != b for a, b in zip(rows(first.src), rows(second.src), strict=True)]
    assert sum(changed) > 0.5 * len(changed)  # most sentences of 10+ pieces get another segmentation
    # Skipped merges leave more, shorter pieces: a drawn epoch is longer than the cached segmentation.
    assert first.src.lengths.sum() > 1.1 * fixed.src.lengths[fixed.indices].sum()


DRAW_IN_A_NEW_PROCESS = """
import sys
from pathlib import Path
import numpy as np
from aiayn.data.bpe_dropout import BpeDropout, EpochSegmentation
from aiayn.data.dataset import EncodedText, ParallelDataset
from aiayn.data.tokenizer import Tokenizer

cache, out = Path(sys.argv[1]), sys.argv[2]
fixed = ParallelDataset(EncodedText.load(cache / "train.en"), EncodedText.load(cache / "train.de"), np.arange(500))
segmentation = EpochSegmentation(fixed, BpeDropout(Tokenizer(cache / "spm.model"), 0.1), seed=3, max_len=256)
segmentation.draw(2)
np.save(out, segmentation.pairs.src.tokens)
"""


def test_the_same_seed_and_epoch_draw_the_same_ids_in_any_process(
    corpus_root: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dm = module(corpus_root, cache_dir, bpe_dropout=0.1, seed=3)
    here = drawn(dm, 2)
    elsewhere = tmp_path / "src.npy"  # drawn by another interpreter: a DDP rank, a resumed run
    command = [sys.executable, "-c", DRAW_IN_A_NEW_PROCESS, str(dm.cache_folder()), str(elsewhere)]
    subprocess.run(command, check=True, timeout=300)
    assert np.array_equal(np.load(elsewhere), here.src.tokens)
    monkeypatch.setattr(bpe_dropout_module, "CHUNK", 128)  # 4 chunks of the 500 pairs, 2 processes drawing them
    one = drawn(module(corpus_root, cache_dir, bpe_dropout=0.1, seed=3), 2, workers=1)
    other = module(corpus_root, cache_dir, bpe_dropout=0.1, seed=3)
    drawn(other, 5)  # another epoch first: nothing carries over
    two = drawn(other, 2, workers=2)
    for side in ("src", "tgt"):
        assert np.array_equal(getattr(one, side).tokens, getattr(two, side).tokens)
        assert np.array_equal(getattr(one, side).offsets, getattr(two, side).offsets)
    reseeded = drawn(module(corpus_root, cache_dir, bpe_dropout=0.1, seed=4), 2)
    assert rows(reseeded.src) != rows(one.src)


def evaluation_batches(dm: Multi30kDataModule, role: str) -> list[tuple[list[list[int]], list[list[int]]]]:
    loader = dm.val_dataloader() if role == "val" else dm.test_dataloader()
    return [(batch["src"].tolist(), batch["tgt_out"].tolist()) for batch in loader]


def test_validation_and_test_ids_and_the_cache_are_those_of_the_fixed_segmentation(
    corpus_root: Path, cache_dir: Path
) -> None:
    sampled, fixed = module(corpus_root, cache_dir, bpe_dropout=0.5), module(corpus_root, cache_dir)
    drawn(sampled, 1)
    assert sampled.cache_folder() == fixed.cache_folder()  # the same cache entry, keys unchanged
    for role in ("val", "test"):
        assert evaluation_batches(sampled, role) == evaluation_batches(fixed, role)


def test_a_drawn_side_longer_than_max_len_keeps_its_cached_ids(corpus_root: Path, cache_dir: Path) -> None:
    fixed = module(corpus_root, cache_dir).datasets["train"]
    longest = int(fixed.src.lengths[fixed.indices].max())
    dm = module(corpus_root, cache_dir, bpe_dropout=0.5, max_len=longest + 1)  # the longest source just fits
    pairs, kept = drawn(dm, 0), dm.datasets["train"].fixed
    assert pairs.src.lengths.max() + 1 <= dm.max_len and pairs.tgt.lengths.max() + 1 <= dm.max_len
    at_limit = [i for i, row in enumerate(kept.indices) if kept.src.lengths[row] == longest]
    assert at_limit  # half of their merges skipped, these sources would outgrow max_len: they stay as cached
    assert all(pairs.src[i].tolist() == kept.src[kept.indices[i]].tolist() for i in at_limit)


def test_back_translated_pairs_are_drawn_too_with_their_tag_in_front(
    corpus_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    extra = tmp_path_factory.mktemp("extra")
    for lang in ("en", "de"):  # the corpus's validation pairs as synthetic ones
        (extra / f"synthetic.{lang}").write_text((corpus_root / f"val.{lang}").read_text(encoding="utf-8"))
    pair = [[str(extra / "synthetic.en"), str(extra / "synthetic.de")]]
    dm = module(corpus_root, tmp_path_factory.mktemp("cache"), bpe_dropout=0.2, extra_train=pair, tag_extra=True)
    tag = dm.tokenizer.sp.piece_to_id(TAG)
    first, second = drawn(dm, 0), drawn(dm, 1)
    real = len(dm.datasets["train"].fixed.parts[0])
    synthetic = range(real, len(first))
    assert len(synthetic) == 100
    assert all(first.src[i][0] == tag and tag not in first.src[i][1:] for i in synthetic)
    assert all(tag not in first.src[i] for i in range(real))
    text = (extra / "synthetic.en").read_text(encoding="utf-8").splitlines()
    assert dm.tokenizer.decode([first.src[i][1:].tolist() for i in synthetic]) == text
    assert sum(first.src[i].tolist() != second.src[i].tolist() for i in synthetic) > 50


@pytest.mark.parametrize("stored_value", [0.1, 7])
def test_evaluating_a_stored_run_leaves_its_bpe_dropout_aside(
    corpus_root: Path, tmp_path: Path, stored_value: float
) -> None:
    """A training setting: evaluation pairs keep the cached ids anyway, and a stored value is not even read."""
    stored = {"_target_": "aiayn.data.Multi30kDataModule", "vocab_size": 1000, "bpe_dropout": stored_value}
    assert instantiated_from_checkpoint(stored, "data", tmp_path / "x.ckpt", root=corpus_root).bpe_dropout == 0.0


class IdRecorder(pl.Callback):
    """The epoch and the source and target ids of every training batch, as the model gets them."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[list[int]], list[list[int]]]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.batches.append((trainer.current_epoch, batch["src"].tolist(), batch["tgt_out"].tolist()))


def recorded_run(run_dir: Path, overrides: list[str]) -> tuple[dict[str, Any], IdRecorder]:
    recorder = IdRecorder()
    return train(compose_run_config(overrides), run_dir, overrides, callbacks=[recorder]), recorder


@pytest.mark.slow
def test_a_run_resumed_mid_epoch_trains_on_the_batches_of_an_uninterrupted_one(
    corpus_root: Path, cache_dir: Path, tmp_path: Path
) -> None:
    drawing = ["data.bpe_dropout=0.3", "seed=4", "decoding.max_len_offset=3"]
    base = resumable_run(corpus_root, cache_dir, *drawing, pairs=40, eval_pairs=4, deterministic=False)
    whole, uninterrupted = recorded_run(tmp_path / "whole", [*base, "trainer.max_steps=9"])
    # Each epoch has as many batches as its own segmentation makes (40 pairs drawn from seed 4: 3, then 4).
    dm = module(corpus_root, cache_dir, bpe_dropout=0.3, seed=4, train_limit=40, max_tokens=500)
    lengths = [len(TokenBudgetBatchSampler(drawn(dm, epoch).padded_lengths(), 500)) for epoch in (0, 1)]
    assert lengths[0] != lengths[1]
    epochs = [epoch for epoch, _, _ in uninterrupted.batches]
    assert [epochs.count(0), epochs.count(1)] == lengths and epochs.count(2) == 9 - sum(lengths)

    # Stopped inside epoch 1, then resumed; a worker process loads their batches (each epoch's loader its own).
    interrupted = [*base, "data.num_workers=1"]
    _, first = recorded_run(tmp_path / "first", [*interrupted, "trainer.max_steps=5"])
    resume = f"resume={tmp_path / 'first' / 'checkpoints' / 'last.ckpt'}"
    second, rest = recorded_run(tmp_path / "second", [*interrupted, "trainer.max_steps=9", resume])
    assert epochs[4] == epochs[5] == 1
    assert first.batches + rest.batches == uninterrupted.batches
    assert second["steps"] == whole["steps"] == 9


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["data.bpe_dropout=1.0"], "data.bpe_dropout=1.0 must be a number in [0, 1)"),
        (["data.bpe_dropout=-0.1"], "data.bpe_dropout=-0.1 must be a number in [0, 1)"),
        (["data.bpe_dropout=often"], "data.bpe_dropout=often must be a number in [0, 1)"),
        (
            ["data.bpe_dropout=0.1", "+trainer.reload_dataloaders_every_n_epochs=2"],
            "trainer.reload_dataloaders_every_n_epochs=2 must be 1 with data.bpe_dropout>0",
        ),
    ],
)
def test_a_bad_bpe_dropout_stops_the_run_in_one_line_naming_the_key(
    overrides: list[str],
    line: str,
    corpus_root: Path,
    cache_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert refusal([*smoke_run(corpus_root, cache_dir), *overrides], monkeypatch, capsys).startswith(line)
