"""Extra training pairs mixed with the real corpus: back-translations, tagged or with the real corpus upsampled.

Back-translation (Sennrich et al. 2016) trains on synthetic pairs: monolingual target-language text and
its translation into the source language by a reverse model, sampled rather than searched (Edunov et al.
2018). Three data settings make the mix (recipe: docs/decoding.md, "Back-translation"):

- ``data.extra_train``: ``[[source file, target file], ...]``, pairs of aligned files used for training
  only (never validated or tested on), relative to ``data.root`` (else the working folder) unless
  absolute. Each is encoded into the cache beside the corpus's splits and filtered as the real
  training pairs are.
- ``data.tag_extra``: the source of every extra pair starts with :data:`TAG` (tagged back-translation,
  Caswell et al. 2019), so that the model can tell synthetic sources from real ones. The tag is a
  user-defined symbol of the BPE model: one piece, never split. It is put in front as an id, not as
  text (sentencepiece would encode ``"<BT> ..."`` as ``▁``, ``<BT>``). The text ``<BT>`` encodes to
  that piece too, so no real sentence nor any target may hold it (refused with its file and line): it
  means "synthetic source" and nothing else, and no target teaches the model to write it.
- ``data.upsample_primary``: the real training pairs are repeated N times in each epoch, against the
  extra ones (fairseq's ``--upsample-primary``).

The extra files' content and the tag are part of the cache key (:meth:`TranslationDataModule.cache_folder
<aiayn.data.datamodule.TranslationDataModule.cache_folder>`), which is also the run's data identity that a
resume and ``aiayn-average`` compare; the tokenizer is still trained on the real corpus only. Upsampling
changes no cached id, only how often the real pairs are drawn, so it is not. ``data.train_limit`` limits
the real pairs; the extra ones are used whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from aiayn.data.corpus import ParallelCorpus, _TextPairs
from aiayn.data.dataset import EncodedText, ParallelDataset
from aiayn.errors import DataError, FieldError, whole

TAG = "<BT>"  # prepended to the extra pairs' sources with data.tag_extra=true
SCAN_BLOCK = 1 << 26  # ids compared at a time when looking for the tag (WMT's splits hold billions)


def check_mix(extra_train: Any, tag_extra: Any, upsample_primary: Any) -> None:
    """The mix's settings, each refused in a :class:`~aiayn.errors.FieldError` of its field."""
    pairs = "must be a list of [source file, target file] pairs, e.g. [[synthetic.en,mono.de]]"
    if isinstance(extra_train, str) or not isinstance(extra_train, Sequence):
        raise FieldError("extra_train", extra_train, pairs)
    for pair in extra_train:
        if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise FieldError("extra_train", list(extra_train), pairs)
        if not all(isinstance(name, str) and name.strip() for name in pair):
            raise FieldError("extra_train", list(pair), "must name two files: [source, target]")
    if not isinstance(tag_extra, bool):
        raise FieldError("tag_extra", tag_extra, "must be true or false")
    if tag_extra and not extra_train:
        raise FieldError("tag_extra", tag_extra, "tags the sources of {extra_train}, which is empty; set it")
    if not whole(upsample_primary, 1):
        raise FieldError("upsample_primary", upsample_primary, "must be a whole number >= 1")
    if upsample_primary > 1 and not extra_train:
        allowed = "repeats the real pairs against those of {extra_train}, which is empty; set it, or 1"
        raise FieldError("upsample_primary", upsample_primary, allowed)


class ExtraPairs(_TextPairs):
    """The pairs of ``data.extra_train`` as a corpus whose splits are ``extra1``, ``extra2``, ... (one per
    pair of files, in order), relative to ``root`` unless absolute."""

    name = "extra"

    def __init__(self, src_lang: str, tgt_lang: str, root: Path | None, pairs: Sequence[Sequence[str]]) -> None:
        super().__init__()
        self.src_lang, self.tgt_lang, self.root = src_lang, tgt_lang, root
        self.paths: dict[str, dict[str, Path]] = {}
        for number, pair in enumerate(pairs, start=1):
            paths = [Path(name).expanduser() if root is None else root / Path(name).expanduser() for name in pair]
            for path in paths:
                if not path.is_file():
                    raise FieldError("extra_train", list(pair), f"names {path}, which is not a file")
            self.paths[f"extra{number}"] = dict(zip((src_lang, tgt_lang), paths, strict=True))
        self.roles = {}

    def splits(self) -> list[str]:
        return list(self.paths)

    def files(self, split: str, lang: str) -> Path:
        return self.paths[split][lang]


def check_tag(corpus: ParallelCorpus, split: str, stems: tuple[Path, Path], tag_id: int, tagged: bool) -> None:
    """A :class:`~aiayn.errors.DataError` naming the file and line of the first sentence of ``split`` (its
    encoded ids at ``stems``, source and target) that holds the tag where it does not belong: anywhere but
    at the start of a ``tagged`` source."""
    for stem, lang, leading in ((stems[0], corpus.src_lang, tagged), (stems[1], corpus.tgt_lang, False)):
        row = misplaced(EncodedText.load(stem), tag_id, leading)
        if row is not None:
            raise DataError(
                f"{corpus.at(split, row, lang)}: holds {TAG}, which data.tag_extra=true reserves for the start of "
                "the sources of data.extra_train; remove it from the text (or set data.tag_extra=false)"
            )


def misplaced(text: EncodedText, tag_id: int, leading: bool) -> int | None:
    """The first sentence of ``text`` holding ``tag_id`` anywhere but, when ``leading``, as its first id."""
    for start in range(0, len(text.tokens), SCAN_BLOCK):
        at = np.flatnonzero(np.asarray(text.tokens[start : start + SCAN_BLOCK]) == tag_id) + start
        rows = np.searchsorted(text.offsets, at, side="right") - 1  # an empty row shares its offset: the next
        if leading:
            rows = rows[text.offsets[rows] != at]
        if len(rows):
            return int(rows[0])
    return None


class TrainingMix(Dataset):
    """The training pairs of an epoch made of several encoded parts (the real pairs, repeated, then each
    extra pair of files'), indexed one after the other: the token-budget sampler batches, shuffles, shards
    and resumes them as one split."""

    def __init__(self, parts: Sequence[ParallelDataset]) -> None:
        self.parts = list(parts)
        self.starts = np.cumsum([0, *map(len, self.parts)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def padded_lengths(self) -> np.ndarray:
        return np.concatenate([part.padded_lengths() for part in self.parts])

    def __getitem__(self, i: int) -> tuple[int, np.ndarray, np.ndarray]:
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        _, src, tgt = self.parts[k][i - int(self.starts[k])]
        return i, src, tgt
