"""The LightningDataModule: a parallel corpus → cached sentencepiece ids → token-budget batches.

:class:`TranslationDataModule` does the work for any :class:`~aiayn.data.corpus.ParallelCorpus`; the
data modules of each kind of corpus are in :mod:`aiayn.data.sources`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from aiayn.data.back_translation import TAG, ExtraPairs, TrainingMix, check_mix, check_tag
from aiayn.data.bpe_dropout import BpeDropout, EpochSegmentation, check_bpe_dropout, check_reload
from aiayn.data.cache import CacheEntry
from aiayn.data.corpus import DataError, ParallelCorpus, default_cache_dir
from aiayn.data.dataset import Collator, EncodedText, ParallelDataset, token_dtype
from aiayn.data.encoding import encode_split
from aiayn.data.limits import check_sizes, check_validation_interval, loader_workers
from aiayn.data.sampler import ResumableDataLoader, TokenBudgetBatchSampler
from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import FieldError
from aiayn.machine import available_cpus

log = logging.getLogger(__name__)

# Bump when the tokenizer's training options or the cache layout change, so old caches are not reused.
CACHE_VERSION = 3  # 3: entries with manifests (data/cache.py), corpus fingerprints with file boundaries
SAMPLE_SEED = 0  # the tokenizer's training sample does not depend on the run's seed: runs share caches
ROLES = ("train", "val", "test")


class TranslationDataModule(pl.LightningDataModule):
    """Batches of one translation direction of ``corpus``.

    One joint BPE model per corpus and vocabulary size is trained on a sample of at most
    ``tokenizer_sample`` training pairs (both languages, §5.1's shared vocabulary) and cached with the
    encoded splits under ``cache_dir``: the first run tokenizes (in ``encode_workers`` processes),
    later runs, every DDP rank and both directions of a pair load memory-mapped ids from disk.

    Training pairs with an empty side, a side longer than ``max_len`` tokens, or sides whose lengths
    differ by more than the factor ``max_len_ratio`` are dropped and counted (:attr:`filtered`);
    evaluation splits are used whole. Batches hold at most ``max_tokens`` tokens (padding included) per
    device and are shared out over the DDP ranks. ``batch_shapes``: the training batches take at most
    that many padded shapes, and one more for a short last batch (:class:`~aiayn.data.sampler.BatchShapes`;
    None: each batch is padded to its own longest sentences). ``num_workers`` processes prepare batches
    (None: :func:`loader_workers`), each ``prefetch_factor`` batches ahead (None: PyTorch's 2).

    ``extra_train``, ``tag_extra`` and ``upsample_primary`` mix more pairs (back-translations) into the
    training pairs only: :mod:`aiayn.data.back_translation`. ``bpe_dropout`` > 0 segments the training
    pairs anew every epoch: :mod:`aiayn.data.bpe_dropout`.
    """

    def __init__(
        self,
        corpus: ParallelCorpus,
        cache_dir: str | None = None,
        vocab_size: int = 8000,
        tokenizer_sample: int = 1_000_000,
        encode_workers: int | None = None,
        max_tokens: int = 4096,
        eval_max_tokens: int | None = None,
        max_len: int = 256,
        max_len_ratio: float | None = None,
        seed: int = 1,
        num_workers: int | None = 0,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        batch_shapes: int | None = None,
        train_limit: int | None = None,
        eval_limit: int | None = None,
        extra_train: Sequence[Sequence[str]] = (),
        tag_extra: bool = False,
        upsample_primary: int = 1,
        bpe_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if corpus.src_lang == corpus.tgt_lang:
            raise FieldError("tgt_lang", corpus.tgt_lang, "is {src_lang} too; translate between two languages")
        check_sizes(
            tokenizer_sample=tokenizer_sample,
            encode_workers=encode_workers,
            max_tokens=max_tokens,
            eval_max_tokens=eval_max_tokens,
            max_len=max_len,
            max_len_ratio=max_len_ratio,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            batch_shapes=batch_shapes,
            train_limit=train_limit,
            eval_limit=eval_limit,
        )
        check_mix(extra_train, tag_extra, upsample_primary)
        check_bpe_dropout(bpe_dropout)
        self.corpus = corpus
        self.extra = ExtraPairs(corpus.src_lang, corpus.tgt_lang, corpus.root, extra_train) if extra_train else None
        self.tag_extra, self.upsample_primary, self.bpe_dropout = tag_extra, upsample_primary, bpe_dropout
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.vocab_size, self.tokenizer_sample, self.encode_workers = vocab_size, tokenizer_sample, encode_workers
        self.max_tokens, self.max_len, self.max_len_ratio = max_tokens, max_len, max_len_ratio
        self.eval_max_tokens = eval_max_tokens or max_tokens
        self.seed, self.num_workers, self.pin_memory = seed, num_workers, pin_memory
        self.prefetch_factor, self.batch_shapes = prefetch_factor, batch_shapes
        self.train_limit, self.eval_limit = train_limit, eval_limit
        self.split_names = corpus.roles
        self.tokenizer: Tokenizer | None = None
        self.datasets: dict[str, ParallelDataset] = {}
        self.references: dict[str, list[str]] = {}
        self.filtered: dict[str, int] = {}
        self._cache: Path | None = None
        self._prepared = False  # train() prepares before the Trainer starts the ranks; Lightning asks again

    @property
    def src_lang(self) -> str:
        return self.corpus.src_lang

    @property
    def tgt_lang(self) -> str:
        return self.corpus.tgt_lang

    @property
    def roles(self) -> list[str]:
        """The roles this corpus has: train, val and, unless it has none, test."""
        return [role for role in ROLES if self.split_names.get(role) is not None]

    # -- the cache --------------------------------------------------------------------------------
    def cache_folder(self) -> Path:
        """Cache folder keyed by the corpus content, the vocabulary size and the tokenizer sample, and by
        the content of the extra training pairs and their tag when there are some."""
        if self._cache is None:
            langs = "-".join(sorted((self.src_lang, self.tgt_lang)))
            # The sample size counts only when it is a sample: a larger setting gives the same model.
            sample = min(self.tokenizer_sample, self.corpus.size(self.split_names["train"]))
            key = f"v{CACHE_VERSION}-{self.vocab_size}-{sample}-{self.corpus.fingerprint()}"
            if self.extra is not None:  # without them the key is as it was: existing caches stay in use
                key += f"-extra-{self.extra.fingerprint()}-tag{int(self.tag_extra)}"
            digest = hashlib.sha256(key.encode()).hexdigest()[:12]
            self._cache = self.cache_dir / "tokenized" / f"{self.corpus.name}-{langs}-bpe{self.vocab_size}-{digest}"
        return self._cache

    def _stem(self, split: str, lang: str) -> Path:
        return self.cache_folder() / f"{split}.{lang}"

    def _train_tokenizer(self, model_file: Path) -> Tokenizer:
        split = self.split_names["train"]
        n = self.corpus.size(split)
        rows = None
        if n > self.tokenizer_sample:  # a bounded, seeded sample: memory and time stay fixed at any scale
            rng = np.random.default_rng(SAMPLE_SEED)
            rows = np.sort(rng.choice(n, size=self.tokenizer_sample, replace=False))
        sides = dict(zip((self.src_lang, self.tgt_lang), self.corpus.read(split, rows), strict=True))
        sample = len(sides[self.src_lang])
        log.info("training a %d-piece joint BPE model on %d of %d training pairs", self.vocab_size, sample, n)
        lines = (line for lang in sorted(sides) for line in sides[lang])  # the same model for both directions
        return Tokenizer.train(lines, self.vocab_size, model_file, symbols=(TAG,) if self.tag_extra else ())

    # -- Lightning hooks --------------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Train the tokenizer and encode every split, unless the cache has them already, whole (Lightning
        calls this on one process per node; the other ranks wait and then load the cache). A damaged
        entry (:mod:`aiayn.data.cache`) is reported in one warning and built again; new ids follow a
        new tokenizer. Done once per process: the cache is verified once per run."""
        if self._prepared:
            return
        model_file = self.cache_folder() / "spm.model"
        tokenizer = CacheEntry(model_file, (model_file,))
        retrained = not tokenizer.usable()
        if retrained:
            self._train_tokenizer(model_file)
            tokenizer.seal()
        dtype = token_dtype(self.vocab_size)
        tag = Tokenizer(model_file).sp.piece_to_id(TAG) if self.tag_extra else None
        parts = [(self.corpus, split) for split in self.corpus.splits()]
        parts += [(self.extra, split) for split in self.extra.splits()] if self.extra is not None else []
        for corpus, split in parts:
            stems = (self._stem(split, self.src_lang), self._stem(split, self.tgt_lang))
            entries = [CacheEntry(stem, EncodedText.files(stem), (model_file,)) for stem in stems]
            if retrained or not all([entry.usable() for entry in entries]):  # a list: each damaged one is reported
                tagged = tag is not None and corpus is self.extra  # the extra pairs' sources start with the tag
                encode_split(corpus, split, model_file, stems, dtype, self.encode_workers, (tag,) if tagged else ())
                if tag is not None:  # before the entry is sealed: a misplaced tag is found again on the next run
                    check_tag(corpus, split, stems, tag, tagged)
                for entry in entries:
                    entry.seal()
        self._prepared = True

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is not None:
            return
        self.tokenizer = Tokenizer(self.cache_folder() / "spm.model")
        for role in self.roles:
            split = self.split_names[role]
            src, tgt = self._encoded(split)
            limit = self.train_limit if role == "train" else self.eval_limit
            indices = np.arange(min(len(src), limit or len(src)))
            if role == "train":
                indices, counts = self._filter_training_pairs(src, tgt, indices, self.corpus.where(split))
                self.filtered |= counts
            else:
                self.references[role] = self.corpus.read(split, indices)[1]
            if len(indices) == 0:
                raise DataError(f"{self.corpus.where(split)} has no sentence pairs")
            self.datasets[role] = ParallelDataset(src, tgt, indices)
            if role == "train" and self.extra is not None:  # the corpus's pairs, upsampled, and the extra ones
                self.datasets[role] = self._training_mix(self.datasets[role])
            if role == "train" and self.bpe_dropout:  # the pairs kept, segmented anew every epoch
                self.datasets[role] = self._epoch_segmentation(self.datasets[role])
            if role != "train":  # evaluation splits are used whole: check them now, not at the first validation
                self._report_empty(role)
                self.check_longest(role, self.eval_max_tokens, "data.eval_max_tokens")

    def _encoded(self, split: str) -> tuple[EncodedText, EncodedText]:
        """The cached source and target ids of ``split``."""
        src = EncodedText.load(self._stem(split, self.src_lang))
        tgt = EncodedText.load(self._stem(split, self.tgt_lang))
        if len(src) != len(tgt):
            raise DataError(f"the cache {self.cache_folder()} is inconsistent for {split}; delete it to re-encode")
        return src, tgt

    def _training_mix(self, real: ParallelDataset) -> TrainingMix:
        """The real training pairs repeated ``upsample_primary`` times, then the kept pairs of each extra
        pair of files; their counts are in :attr:`filtered` as ``extra_<reason>``, and ``epoch_pairs``."""
        assert self.extra is not None
        parts = [ParallelDataset(real.src, real.tgt, np.tile(real.indices, self.upsample_primary))]
        counts: dict[str, int] = {}
        for split in self.extra.splits():
            src, tgt = self._encoded(split)
            indices, dropped = self._filter_training_pairs(src, tgt, np.arange(len(src)), self.extra.where(split))
            counts = {key: counts.get(key, 0) + value for key, value in dropped.items()}
            parts.append(ParallelDataset(src, tgt, indices))
        mix = TrainingMix(parts)
        self.filtered |= {f"extra_{key}": value for key, value in counts.items()} | {"epoch_pairs": len(mix)}
        return mix

    def _epoch_segmentation(self, fixed: ParallelDataset | TrainingMix) -> EpochSegmentation:
        """The training pairs of ``fixed`` segmented anew every epoch (:mod:`aiayn.data.bpe_dropout`), the
        tag of tagged back-translations kept in front."""
        assert self.tokenizer is not None
        keep = (self.tokenizer.sp.piece_to_id(TAG),) if self.tag_extra else ()
        bpe = BpeDropout(self.tokenizer, self.bpe_dropout, keep)
        return EpochSegmentation(fixed, bpe, seed=self.seed, max_len=self.max_len)

    def _filter_training_pairs(
        self, src: EncodedText, tgt: EncodedText, indices: np.ndarray, where: str
    ) -> tuple[np.ndarray, dict[str, int]]:
        """Drop empty, over-long and length-mismatched training pairs of ``where``; count each reason."""
        src_len, tgt_len = src.lengths[indices], tgt.lengths[indices]
        empty = (src_len == 0) | (tgt_len == 0)
        too_long = ~empty & ((src_len + 1 > self.max_len) | (tgt_len + 1 > self.max_len))
        ratio = np.zeros_like(empty)
        if self.max_len_ratio is not None:
            longer, shorter = np.maximum(src_len, tgt_len), np.maximum(np.minimum(src_len, tgt_len), 1)
            ratio = ~empty & ~too_long & (longer > self.max_len_ratio * shorter)
        keep = ~(empty | too_long | ratio)
        counts = {
            "pairs": len(indices),
            "kept": int(keep.sum()),
            "empty": int(empty.sum()),
            "too_long": int(too_long.sum()),
            "length_ratio": int(ratio.sum()),
        }
        if not keep.all():
            log.warning(
                "%s: dropped %d empty, %d over-long (> data.max_len=%d tokens) and %d length-mismatched "
                "(> data.max_len_ratio=%s) training pairs of %d",
                where,
                counts["empty"],
                counts["too_long"],
                self.max_len,
                counts["length_ratio"],
                self.max_len_ratio,
                len(indices),
            )
        if not keep.any():
            raise DataError(f"{where}: no training pair left after filtering; check the data and data.max_len")
        return indices[keep], counts

    def check_longest(self, role: str, limit: int, key: str) -> None:
        """Every pair of ``role`` is at most ``limit`` tokens long (source + EOS, BOS + target), else a
        :class:`DataError` that names the file and line of the longest and the setting ``key`` to raise."""
        dataset = self.datasets[role]
        lengths = dataset.padded_lengths()
        worst, side = np.unravel_index(int(lengths.argmax()), lengths.shape)
        if lengths[worst, side] > limit:
            row = int(dataset.indices[worst])
            where = self.corpus.at(self.split_names[role], row, self.src_lang if side == 0 else self.tgt_lang)
            raise DataError(
                f"{where}: this {role} sentence is {lengths[worst, side]} tokens long, more than {key}={limit}; "
                f"raise {key} or remove the sentence"
            )

    def _report_empty(self, role: str) -> None:
        """Empty sentences of an evaluation split are kept (scores count them) and reported."""
        dataset = self.datasets[role]
        empty = np.flatnonzero(
            (dataset.src.lengths[dataset.indices] == 0) | (dataset.tgt.lengths[dataset.indices] == 0)
        )
        if len(empty):
            first = self.corpus.at(self.split_names[role], int(dataset.indices[empty[0]]), self.src_lang)
            log.warning("%s: %d %s pair(s) with an empty side, kept (the first: %s)", role, len(empty), role, first)
        self.filtered[f"{role}_empty"] = len(empty)

    def split_texts(self, role: str) -> tuple[list[str], list[str]]:
        """Raw source and target lines of the ``train``, ``val`` or ``test`` split, aligned."""
        if role not in ROLES or self.split_names.get(role) is None:
            raise ValueError(f"split={role!r} is not a split of this corpus; use one of {', '.join(self.roles)}")
        return self.corpus.read(self.split_names[role])

    # -- loaders ----------------------------------------------------------------------------------
    def _ranks(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def _sampler(self, role: str, max_tokens: int) -> TokenBudgetBatchSampler:
        world, rank = self._ranks()
        training = role == "train"
        group = self.trainer.accumulate_grad_batches if training and self.trainer is not None else 1
        return TokenBudgetBatchSampler(
            self.datasets[role].padded_lengths(),
            max_tokens,
            seed=self.seed,
            shuffle=training,
            num_replicas=world,
            rank=rank,
            even=training,
            group=group,
            shapes=self.batch_shapes if training else None,
        )

    def _collator(self, role: str, sampler: TokenBudgetBatchSampler) -> Collator:
        assert self.tokenizer is not None, "call setup() first"
        tok = self.tokenizer
        # Only attention over packed sequences reads where the real tokens are; a module that does not
        # say (or no module: a benchmark's loop) gets them.
        module = self.trainer.lightning_module if self.trainer is not None else None
        packing = getattr(module, "packed_attention", True)
        return Collator(tok.pad_id, tok.bos_id, tok.eos_id, self.references.get(role), sampler.shapes, packing)

    def _loader_options(self) -> dict[str, Any]:
        processes = self.trainer.num_devices if self.trainer is not None else 1
        workers = self.num_workers if self.num_workers is not None else loader_workers(processes)
        return {
            "num_workers": workers,
            "prefetch_factor": self.prefetch_factor if workers > 0 else None,
            "pin_memory": self.pin_memory,
            "persistent_workers": workers > 0,
            # A loader seeds its workers from this generator, not from the global one that dropout draws
            # from: starting to iterate mid-epoch (a resumed run) must not shift the dropout masks.
            "generator": torch.Generator().manual_seed(self.seed),
        }

    def _consumed_batches(self) -> int:
        """Training batches this rank has finished in the current epoch, as Lightning counts them."""
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def trainer_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` (``pl.Trainer``'s arguments) with what this data needs of the trainer: with
        ``bpe_dropout``, a new training loader every epoch, made of that epoch's segmentation."""
        if not self.bpe_dropout:
            return options
        if options.get("reload_dataloaders_every_n_epochs") not in (None, 0):  # 0, Lightning's default: unset
            check_reload(options["reload_dataloaders_every_n_epochs"])
        return options | {"reload_dataloaders_every_n_epochs": 1}

    def _draw_epoch(self, segmentation: EpochSegmentation, epoch: int) -> None:
        """Segment the training pairs as ``epoch`` does, in the processes this rank may use."""
        processes = self.encode_workers or available_cpus()
        if self.trainer is not None:
            check_reload(self.trainer.reload_dataloaders_every_n_epochs)  # one loader would keep one segmentation
            processes = max(1, processes // self.trainer.num_devices)  # the ranks on this machine draw at once
        segmentation.draw(epoch, processes)

    def train_dataloader(self) -> DataLoader:
        # Lightning starts iterating (and worker processes start drawing batches) before it sets the
        # epoch; a run resumed at an epoch boundary must not replay epoch 0's order.
        epoch = self.trainer.fit_loop.epoch_progress.current.processed if self.trainer is not None else 0
        if isinstance(self.datasets["train"], EpochSegmentation):  # batches of this epoch's segmentation
            self._draw_epoch(self.datasets["train"], epoch)
        sampler = self._sampler("train", self.max_tokens)
        sampler.set_epoch(epoch)
        if self.trainer is not None:
            check_validation_interval(self.trainer, len(sampler))
        return ResumableDataLoader(
            self.datasets["train"],
            batch_sampler=sampler,
            collate_fn=self._collator("train", sampler),
            consumed=self._consumed_batches,
            **self._loader_options(),
        )

    def _eval_loader(self, role: str) -> DataLoader:
        sampler = self._sampler(role, self.eval_max_tokens)
        return DataLoader(
            self.datasets[role],
            batch_sampler=sampler,
            collate_fn=self._collator(role, sampler),
            **self._loader_options(),
        )

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
