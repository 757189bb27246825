"""Encoded splits on disk (flat token arrays + offsets, memory-mapped) and the parallel dataset over them."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


@dataclass
class EncodedText:
    """Token ids of many sentences: sentence ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``."""

    tokens: np.ndarray
    offsets: np.ndarray

    @classmethod
    def from_ids(cls, ids: Sequence[Sequence[int]]) -> EncodedText:
        lengths = np.fromiter((len(row) for row in ids), dtype=np.int64, count=len(ids))
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.fromiter((t for row in ids for t in row), dtype=np.int32, count=int(offsets[-1]))
        return cls(tokens, offsets)

    def save(self, stem: Path) -> None:
        """Write ``<stem>.tokens.npy`` and ``<stem>.offsets.npy``; the offsets last, as the commit mark."""
        for suffix, array in (("tokens", self.tokens), ("offsets", self.offsets)):
            # A unique temporary name: concurrent first runs never write into each other's file.
            with tempfile.NamedTemporaryFile(dir=stem.parent, suffix=".npy", delete=False) as tmp:
                np.save(tmp, array)
            os.replace(tmp.name, stem.with_name(f"{stem.name}.{suffix}.npy"))

    @classmethod
    def load(cls, stem: Path) -> EncodedText:
        return cls(
            np.load(stem.with_name(f"{stem.name}.tokens.npy"), mmap_mode="r"),
            np.load(stem.with_name(f"{stem.name}.offsets.npy")),
        )

    @staticmethod
    def exists(stem: Path) -> bool:
        return stem.with_name(f"{stem.name}.offsets.npy").is_file()

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]


class ParallelDataset(Dataset):
    """The sentence pairs ``indices`` of an encoded split."""

    def __init__(self, src: EncodedText, tgt: EncodedText, indices: np.ndarray) -> None:
        self.src, self.tgt, self.indices = src, tgt, np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def sizes(self) -> np.ndarray:
        """Per pair: the longer of source + EOS and target + BOS/EOS, i.e. its padded length in a batch."""
        return np.maximum(self.src.lengths[self.indices], self.tgt.lengths[self.indices]) + 1

    def __getitem__(self, i: int) -> tuple[int, np.ndarray, np.ndarray]:
        j = int(self.indices[i])
        return i, self.src[j], self.tgt[j]


class Collator:
    """Pads a list of pairs into the batch the model trains on.

    ``src`` gets EOS appended; the decoder reads ``tgt_in`` = BOS + target and predicts ``tgt_out`` =
    target + EOS (teacher forcing, §3 and Figure 1's "outputs shifted right"). With ``references``
    (raw target text by dataset position) evaluation batches carry the text that BLEU compares against.
    """

    def __init__(self, pad_id: int, bos_id: int, eos_id: int, references: Sequence[str] | None = None) -> None:
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.references = references

    def __call__(self, items: list[tuple[int, np.ndarray, np.ndarray]]) -> dict[str, Any]:
        n = len(items)
        src_len = max(len(s) for _, s, _ in items) + 1
        tgt_len = max(len(t) for _, _, t in items) + 1
        src = torch.full((n, src_len), self.pad_id, dtype=torch.long)
        tgt_in = torch.full((n, tgt_len), self.pad_id, dtype=torch.long)
        tgt_out = torch.full((n, tgt_len), self.pad_id, dtype=torch.long)
        for row, (_, s, t) in enumerate(items):
            src[row, : len(s)] = torch.from_numpy(s.astype(np.int64))
            src[row, len(s)] = self.eos_id
            tgt_in[row, 0] = self.bos_id
            tgt_in[row, 1 : len(t) + 1] = torch.from_numpy(t.astype(np.int64))
            tgt_out[row, : len(t)] = tgt_in[row, 1 : len(t) + 1]
            tgt_out[row, len(t)] = self.eos_id
        batch: dict[str, Any] = {
            "src": src,
            "tgt_in": tgt_in,
            "tgt_out": tgt_out,
            "index": torch.tensor([i for i, _, _ in items], dtype=torch.long),
            # Real (non-padding) tokens per pair, source + EOS and target + EOS, kept in NumPy so that
            # they stay on the CPU: throughput and MFU read them without waiting for the GPU.
            "lengths": np.array([(len(s) + 1, len(t) + 1) for _, s, t in items], dtype=np.int64),
        }
        if self.references is not None:
            batch["references"] = [self.references[i] for i, _, _ in items]
        return batch
