"""The LightningDataModule: raw parallel text → cached sentencepiece ids → token-budget batches."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
from torch.utils.data import DataLoader

from aiayn.data.corpus import (
    MULTI30K_LANGS,
    MULTI30K_SPLITS,
    DataError,
    default_cache_dir,
    download_multi30k,
    read_lines,
    read_parallel,
    split_file,
)
from aiayn.data.dataset import Collator, EncodedText, ParallelDataset
from aiayn.data.sampler import TokenBudgetBatchSampler
from aiayn.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bump when the tokenizer's training options or the cache layout change, so old caches are not reused.
CACHE_VERSION = 1


class Multi30kDataModule(pl.LightningDataModule):
    """Multi30k task 1 in one direction (``src_lang`` → ``tgt_lang`` among en, de, fr).

    The corpus comes from ``root``; when ``root`` is unset, from ``<cache_dir>/multi30k``, downloaded
    there on first use. One joint BPE model per corpus and vocabulary size is trained on the training
    text of both languages and cached with the encoded splits: the first run tokenizes, later runs
    (and both directions of a pair) load ids from disk.
    """

    def __init__(
        self,
        src_lang: str = "en",
        tgt_lang: str = "de",
        root: str | None = None,
        cache_dir: str | None = None,
        vocab_size: int = 8000,
        max_tokens: int = 4096,
        eval_max_tokens: int | None = None,
        max_len: int = 256,
        seed: int = 1,
        num_workers: int = 0,
        pin_memory: bool = False,
        train_limit: int | None = None,
        eval_limit: int | None = None,
        val_split: str = "val",
        test_split: str = "test",
    ) -> None:
        super().__init__()
        for lang in (src_lang, tgt_lang):
            if lang not in MULTI30K_LANGS:
                raise ValueError(f"data language {lang!r} is not in Multi30k; use one of {', '.join(MULTI30K_LANGS)}")
        if src_lang == tgt_lang:
            raise ValueError(f"data.src_lang and data.tgt_lang are both {src_lang!r}; choose two languages")
        for key, split in (("val_split", val_split), ("test_split", test_split)):
            if split not in MULTI30K_SPLITS:
                raise ValueError(f"data.{key}={split!r} must be one of {', '.join(MULTI30K_SPLITS)}")
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.root = Path(root).expanduser() if root else None
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.vocab_size, self.max_tokens, self.max_len = vocab_size, max_tokens, max_len
        self.eval_max_tokens = eval_max_tokens or max_tokens
        self.seed, self.num_workers, self.pin_memory = seed, num_workers, pin_memory
        self.train_limit, self.eval_limit = train_limit, eval_limit
        self.split_names = {"train": "train", "val": val_split, "test": test_split}
        self.tokenizer: Tokenizer | None = None
        self.datasets: dict[str, ParallelDataset] = {}
        self.references: dict[str, list[str]] = {}
        self._locations: tuple[Path, Path] | None = None

    # -- where things are -------------------------------------------------------------------------
    def corpus_dir(self) -> Path:
        if self.root is not None:
            if not self.root.is_dir():
                raise DataError(f"data.root={self.root} is not a folder; point it at the Multi30k task-1 raw files")
            return self.root
        return download_multi30k(self.cache_dir / "multi30k", MULTI30K_LANGS)

    def _files(self, corpus: Path, split: str, lang: str) -> Path:
        return split_file(corpus, MULTI30K_SPLITS[split], lang)

    def locations(self) -> tuple[Path, Path]:
        """The corpus folder and its tokenized cache folder, resolved (and hashed) once per instance."""
        if self._locations is None:
            corpus = self.corpus_dir()
            self._locations = corpus, self.tokenized_dir(corpus)
        return self._locations

    def tokenized_dir(self, corpus: Path) -> Path:
        """Cache folder keyed by the content of every file used and the vocabulary size."""
        langs = sorted((self.src_lang, self.tgt_lang))
        digest = hashlib.sha256(f"v{CACHE_VERSION}-{self.vocab_size}".encode())
        for split in MULTI30K_SPLITS:
            for lang in langs:
                digest.update(self._files(corpus, split, lang).read_bytes())
        name = f"multi30k-{'-'.join(langs)}-bpe{self.vocab_size}-{digest.hexdigest()[:12]}"
        return self.cache_dir / "tokenized" / name

    def split_texts(self, split: str) -> tuple[list[str], list[str]]:
        """Raw source and target lines of a corpus split (``train``, ``val`` or ``test``), aligned."""
        if split not in MULTI30K_SPLITS:
            raise ValueError(f"split={split!r} is not a Multi30k split; use one of {', '.join(MULTI30K_SPLITS)}")
        corpus = self.corpus_dir()
        return read_parallel(self._files(corpus, split, self.src_lang), self._files(corpus, split, self.tgt_lang))

    # -- Lightning hooks --------------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Train the tokenizer and encode every split, unless the cache has them already."""
        corpus, cache = self.locations()
        model_file = cache / "spm.model"
        langs = sorted((self.src_lang, self.tgt_lang))
        if model_file.is_file():
            tokenizer = Tokenizer(model_file)
        else:
            train = [read_lines(self._files(corpus, "train", lang)) for lang in langs]
            log.info("training a %d-piece joint BPE model on %s", self.vocab_size, corpus)
            tokenizer = Tokenizer.train((line for side in train for line in side), self.vocab_size, model_file)
        for split in MULTI30K_SPLITS:
            for lang in langs:
                stem = cache / f"{split}.{lang}"
                if not EncodedText.exists(stem):
                    EncodedText.from_ids(tokenizer.encode(read_lines(self._files(corpus, split, lang)))).save(stem)

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is not None:
            return
        corpus, cache = self.locations()
        self.tokenizer = Tokenizer(cache / "spm.model")
        for role, split in self.split_names.items():
            src_file, tgt_file = self._files(corpus, split, self.src_lang), self._files(corpus, split, self.tgt_lang)
            _, tgt_text = read_parallel(src_file, tgt_file)  # also checks the alignment
            src = EncodedText.load(cache / f"{split}.{self.src_lang}")
            tgt = EncodedText.load(cache / f"{split}.{self.tgt_lang}")
            limit = self.train_limit if role == "train" else self.eval_limit
            indices = np.arange(min(len(src), limit or len(src)))
            if role == "train":
                indices = self._filter_training_pairs(src, tgt, indices, src_file)
            self.datasets[role] = ParallelDataset(src, tgt, indices)
            self.references[role] = [tgt_text[i] for i in indices]

    def _filter_training_pairs(
        self, src: EncodedText, tgt: EncodedText, indices: np.ndarray, src_file: Path
    ) -> np.ndarray:
        """Drop empty and over-long training pairs, and say how many."""
        src_len, tgt_len = src.lengths[indices], tgt.lengths[indices]
        empty = (src_len == 0) | (tgt_len == 0)
        too_long = (src_len + 1 > self.max_len) | (tgt_len + 1 > self.max_len)
        keep = ~(empty | too_long)
        if not keep.all():
            log.warning(
                "%s: dropped %d empty and %d over-long (> data.max_len=%d tokens) training pairs of %d",
                src_file,
                int(empty.sum()),
                int((too_long & ~empty).sum()),
                self.max_len,
                len(indices),
            )
        if not keep.any():
            raise DataError(f"{src_file}: no training pair left after filtering; check the data and data.max_len")
        return indices[keep]

    def _loader(self, role: str, shuffle: bool, max_tokens: int) -> DataLoader:
        assert self.tokenizer is not None, "call setup() first"
        dataset = self.datasets[role]
        tok = self.tokenizer
        references = None if role == "train" else self.references[role]
        return DataLoader(
            dataset,
            batch_sampler=TokenBudgetBatchSampler(dataset.sizes(), max_tokens, seed=self.seed, shuffle=shuffle),
            collate_fn=Collator(tok.pad_id, tok.bos_id, tok.eos_id, references),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True, self.max_tokens)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False, self.eval_max_tokens)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", False, self.eval_max_tokens)
