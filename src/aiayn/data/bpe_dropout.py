"""BPE-dropout while training (``data.bpe_dropout``): every epoch sees the training pairs in another
segmentation, in which each merge of the BPE model is skipped at random (Provilkov et al., 2020, subword
regularisation). 0, the default, is the paper's one fixed segmentation (§5.1).

- The segmentation is sentencepiece's BPE encoding (its ``bpe_model.cc``: merge the adjacent pair that
  makes the best-scored piece, the leftmost among equals; skip a merge with probability p) re-done here
  from the cached ids, word by word. sentencepiece's own sampling (0.2.3) cannot be repeated: it draws
  from absl's ``BitGen``, and the same seed draws other segmentations in another process (a DDP rank, a
  resumed run), as absl salts seeds with each process's entropy. Here the draws come from NumPy
  generators seeded from (``data.seed``, epoch, chunk of :data:`CHUNK` pairs, side): the same on every
  rank, in a resumed run, whatever the batch order or the number of processes drawing. With p = 0 it
  gives the cached ids.
- An epoch is segmented whole, in memory, when its training loader is made, before batching: the
  token-budget sampler needs every pair's length, and a drawn segmentation is longer than the cached one
  (about 40% more tokens at p = 0.1 with 8000 pieces). Batching, sharding over DDP ranks and resuming
  mid-epoch are those of fixed ids; each epoch has its own batches and its own number of them, so
  Lightning makes a new loader every epoch (``trainer.reload_dataloaders_every_n_epochs=1``, which
  :meth:`~aiayn.data.datamodule.TranslationDataModule.trainer_options` sets).
- A drawn side longer than ``data.max_len`` tokens keeps its cached ids: no pair outgrows the limits
  that training checked (the model's positions, the token budget). Filtering uses the cached lengths,
  so every epoch holds the same pairs. Words with an unknown piece or the back-translation tag keep
  their pieces.
- Validation and test pairs keep their cached ids. The pairs of ``data.extra_train`` (back-translations)
  are training pairs: they are drawn too, their tag kept in front; upsampled real pairs are drawn once
  per copy. The cache holds the fixed segmentation as before, under the same keys.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from aiayn.data.back_translation import TrainingMix
from aiayn.data.dataset import EncodedText, ParallelDataset
from aiayn.data.encoding import flatten, in_workers
from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import FieldError, is_number

log = logging.getLogger(__name__)

CHUNK = 2048  # training pairs drawn from one generator per side, and per job of a drawing process
WORDS = 1 << 16  # words whose first candidate pairs are kept, per process (~1 KB each; Multi30k has 40k)
SPACE = "▁"  # sentencepiece's word boundary: no piece has it but at its start, so words are segmented alone


def check_bpe_dropout(value: Any) -> None:
    """``data.bpe_dropout`` is the probability of skipping a merge: a number in [0, 1)."""
    if not (is_number(value) and 0 <= value < 1):
        raise FieldError("bpe_dropout", value, "must be a number in [0, 1): 0 is off, 0.1 is usual")


def check_reload(every: Any) -> None:
    """Lightning makes a new training loader every epoch (``trainer.reload_dataloaders_every_n_epochs``):
    one loader would keep one epoch's segmentation and number of batches."""
    if every != 1:
        allowed = "must be 1 with {bpe_dropout}>0: every epoch is segmented and batched anew"
        raise FieldError("reload_dataloaders_every_n_epochs", every, allowed)


def draw_seed(seed: int, epoch: int, chunk: int, side: int) -> int:
    """The seed of the draws of one side (0: source, 1: target) of chunk ``chunk`` of the training pairs in
    ``epoch`` of a run seeded with ``seed``: a hash, so that neighbouring seeds and epochs draw unrelated
    segmentations."""
    digest = hashlib.sha256(f"bpe-dropout {seed} {epoch} {chunk} {side}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


class BpeDropout:
    """The BPE segmentation of a sentencepiece model with each merge skipped with probability ``dropout``.

    ``keep``: ids of pieces never re-segmented (the back-translation tag); unknown and control pieces never are.
    """

    def __init__(self, tokenizer: Tokenizer, dropout: float, keep: Iterable[int] = ()) -> None:
        sp = tokenizer.sp
        self.size = sp.get_piece_size()
        self.dropout = dropout
        pieces = [sp.id_to_piece(i) for i in range(self.size)]
        special = {
            i for i in range(self.size) if sp.is_unknown(i) or sp.is_control(i) or sp.is_unused(i) or sp.is_byte(i)
        }
        self.kept = special | set(keep)
        self.id_of = {piece: i for i, piece in enumerate(pieces) if i not in special}
        # The pieces a merge makes, as sentencepiece's encoder looks them up: the id of each piece that is two
        # others put together, by the pair (a * size + b), with its negated score (the best first).
        self.merge = {
            self.id_of[piece[:k]] * self.size + self.id_of[piece[k:]]: (-sp.get_score(i), i)
            for piece, i in self.id_of.items()
            for k in range(1, len(piece))
            if piece[:k] in self.id_of and piece[k:] in self.id_of
        }
        self.pieces = pieces
        self.word_start = [piece.startswith(SPACE) for piece in pieces]
        self.chars = [len(piece) for piece in pieces]
        self._words: dict[tuple[int, ...], Word] = {}  # the words seen, up to WORDS of them

    def sentences(self, text: EncodedText, rng: np.random.Generator) -> list[list[int]]:
        """Each sentence of ``text`` (cached ids) segmented anew, with draws from ``rng``."""
        # A word of n characters draws at most 3(n - 1) times: n - 1 merges, and a skip for each pair
        # the merges (two new pairs each) or the characters (n - 1 pairs) make.
        skips = rng.random(3 * int(np.take(self.chars, text.tokens).sum())) < self.dropout
        draws = Draws(skips.tolist(), np.concatenate([[0], np.cumsum(skips)]).tolist())
        return [self._sentence(text[i].tolist(), draws) for i in range(len(text))]

    def _sentence(self, ids: list[int], draws: Draws) -> list[int]:
        out: list[int] = []
        start = 0
        for end in range(1, len(ids) + 1):
            if end < len(ids) and not self.word_start[ids[end]]:
                continue
            pieces = tuple(ids[start:end])
            start = end
            word = self._words.get(pieces) or self._word(pieces)
            # Its cached segmentation's merges all drawn, none skipped: the cached pieces.
            if not word.chars or draws.none_skipped(word.merges):
                out += pieces
            else:
                out += self._segment(word, draws)
        return out

    def _word(self, pieces: tuple[int, ...]) -> Word:
        """What segmenting the word of ``pieces`` starts from."""
        text = "".join(self.pieces[i] for i in pieces)
        if any(i in self.kept for i in pieces) or any(char not in self.id_of for char in text):
            word = Word((), 0, ())
        else:
            chars = tuple(self.id_of[char] for char in text)
            # Candidate pairs, the best score first, then the leftmost: (-score, left, right, a, b).
            pairs = [
                (self.merge[a * self.size + b][0], i, i + 1, a, b)
                for i, (a, b) in enumerate(pairwise(chars))
                if a * self.size + b in self.merge
            ]
            heapq.heapify(pairs)
            word = Word(chars, len(chars) - len(pieces), tuple(pairs))
        if len(self._words) < WORDS:
            self._words[pieces] = word
        return word

    def _segment(self, word: Word, draws: Draws) -> list[int]:
        """sentencepiece's BPE encoding of ``word`` (bpe_model.cc), a merge skipped when its draw says so."""
        merge, size, agenda = self.merge, self.size, list(word.agenda)
        symbols = list(word.chars)  # merged into the left symbol; -1 once merged away
        after = [*range(1, len(symbols)), -1]
        before = list(range(-1, len(symbols) - 1))
        while agenda:
            _, left, right, a, b = heapq.heappop(agenda)
            if symbols[left] != a or symbols[right] != b:
                continue  # a symbol of the pair was merged since (a merge only makes longer pieces)
            if draws.skip():
                continue
            symbols[left] = merged = merge[a * size + b][1]
            symbols[right] = -1
            after[left] = following = after[right]
            if following != -1:
                before[following] = left
                if (pair := merge.get(merged * size + symbols[following])) is not None:
                    heapq.heappush(agenda, (pair[0], left, following, merged, symbols[following]))
            if (previous := before[left]) != -1 and (pair := merge.get(symbols[previous] * size + merged)) is not None:
                heapq.heappush(agenda, (pair[0], previous, left, symbols[previous], merged))
        return [symbol for symbol in symbols if symbol != -1]


@dataclass(frozen=True)
class Word:
    """A word's characters (as pieces; empty: the word is kept as it is), the merges of its cached
    segmentation and its first candidate pairs."""

    chars: tuple[int, ...]
    merges: int
    agenda: tuple[tuple[float, int, int, int, int], ...]  # a heap


class Draws:
    """One generator's skip decisions, used in order: ``skips[k]``, and ``counts[k]`` of them before k."""

    def __init__(self, skips: list[bool], counts: list[int]) -> None:
        self.skips, self.counts, self.used = skips, counts, 0

    def skip(self) -> bool:
        self.used += 1
        return self.skips[self.used - 1]

    def none_skipped(self, n: int) -> bool:
        """Use the next ``n`` decisions if none of them skips (a run of merges as the cached segmentation's)."""
        if self.counts[self.used + n] != self.counts[self.used]:
            return False
        self.used += n
        return True


_worker: dict[str, BpeDropout] = {}  # a drawing process's model


def _start_worker(bpe: BpeDropout) -> None:
    _worker["bpe"] = bpe


def _draw_chunk(
    job: tuple[EncodedText, EncodedText, tuple[int, int], int],
) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """One chunk of training pairs drawn: ``job`` is (source ids, target ids, each side's seed, max_len)."""
    *texts, seeds, max_len = job
    sides = []
    for text, seed in zip(texts, seeds, strict=True):
        drawn = _worker["bpe"].sentences(text, np.random.default_rng(seed))
        # A side drawn longer than max_len with its EOS keeps its cached ids, which training kept.
        ids = [row if len(row) < max_len else text[i].tolist() for i, row in enumerate(drawn)]
        sides.append(flatten(ids, text.tokens.dtype))
    return tuple(sides)


def _gathered(rows: list[np.ndarray]) -> EncodedText:
    """Sentences' ids as one :class:`EncodedText` in memory."""
    return EncodedText.joined([(np.concatenate(rows), np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)))])


class EpochSegmentation(Dataset):
    """The training pairs of ``fixed`` (cached ids) in the segmentation of the epoch last :meth:`draw`-n by
    ``bpe``, from ``seed`` and the epoch; a side stays within ``max_len`` tokens with its EOS."""

    def __init__(self, fixed: ParallelDataset | TrainingMix, bpe: BpeDropout, *, seed: int, max_len: int) -> None:
        self.fixed, self.bpe, self.seed, self.max_len = fixed, bpe, seed, max_len
        self.epoch: int | None = None
        self._pairs: ParallelDataset | None = None

    def draw(self, epoch: int, workers: int = 1) -> None:
        """Segment the training pairs as ``epoch`` does, in ``workers`` processes (once per epoch)."""
        if epoch == self.epoch:
            return
        start = time.perf_counter()
        workers = max(1, min(workers, math.ceil(len(self) / CHUNK)))
        chunks = list(in_workers(_draw_chunk, self._jobs(epoch), workers, _start_worker, (self.bpe,)))
        src, tgt = (EncodedText.joined([chunk[side] for chunk in chunks]) for side in (0, 1))
        self._pairs, self.epoch = ParallelDataset(src, tgt, np.arange(len(src))), epoch
        log.info(
            "epoch %d: %d training pairs segmented with data.bpe_dropout=%s in %.2f s (%d process(es))",
            epoch,
            len(src),
            self.bpe.dropout,
            time.perf_counter() - start,
            workers,
        )

    def _jobs(self, epoch: int) -> Iterator[tuple[EncodedText, EncodedText, tuple[int, int], int]]:
        for chunk, start in enumerate(range(0, len(self), CHUNK)):
            _, src, tgt = zip(*(self.fixed[i] for i in range(start, min(start + CHUNK, len(self)))), strict=True)
            seeds = (draw_seed(self.seed, epoch, chunk, 0), draw_seed(self.seed, epoch, chunk, 1))
            yield _gathered(list(src)), _gathered(list(tgt)), seeds, self.max_len

    @property
    def pairs(self) -> ParallelDataset:
        """The drawn epoch's ids."""
        if self._pairs is None:
            raise RuntimeError("no epoch drawn yet: call draw(epoch) before batching")
        return self._pairs

    def __len__(self) -> int:
        return len(self.fixed)

    def padded_lengths(self) -> np.ndarray:
        return self.pairs.padded_lengths()

    def __getitem__(self, i: int) -> tuple[int, np.ndarray, np.ndarray]:
        return self.pairs[i]
