"""Encoded splits on disk (flat token arrays + offsets, memory-mapped) and the parallel dataset over them."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from aiayn.files import atomic_write, temporary_file

if TYPE_CHECKING:
    from aiayn.data.sampler import BatchShapes


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest id type for ``vocab_size`` pieces: 2 bytes per token up to 65536 (37000 for WMT14)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


@dataclass
class EncodedText:
    """Token ids of many sentences: sentence ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``.

    On disk: ``<stem>.tokens.npy`` (memory-mapped when loaded: every DataLoader worker and DDP rank
    shares the page cache instead of holding a copy) and ``<stem>.offsets.npy``.
    """

    tokens: np.ndarray
    offsets: np.ndarray

    @classmethod
    def load(cls, stem: Path) -> EncodedText:
        tokens, offsets = cls.files(stem)
        return cls(np.load(tokens, mmap_mode="r"), np.load(offsets))

    @classmethod
    def joined(cls, pieces: Sequence[tuple[np.ndarray, np.ndarray]]) -> EncodedText:
        """Sentences held in memory, from (flat token ids, per-sentence lengths) pieces, at least one, in order."""
        tokens = np.concatenate([tokens for tokens, _ in pieces])
        lengths = np.concatenate([lengths for _, lengths in pieces])
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(tokens, offsets)

    @staticmethod
    def files(stem: Path) -> tuple[Path, Path]:
        """The token and offset files of the entry ``stem``."""
        return stem.with_name(f"{stem.name}.tokens.npy"), stem.with_name(f"{stem.name}.offsets.npy")

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]


class EncodedTextWriter:
    """Writes an :class:`EncodedText` chunk by chunk, never holding a whole split in memory.

    Tokens stream into a temporary file; :meth:`close` puts the ``.npy`` header in front and writes
    both files atomically (:func:`~aiayn.files.atomic_write`): concurrent writers (one per node) never
    write into each other's files. The cache's manifest (:mod:`aiayn.data.cache`), written after
    them, says that the entry is complete.
    """

    def __init__(self, stem: Path, dtype: np.dtype) -> None:
        self.stem, self.dtype = stem, np.dtype(dtype)
        stem.parent.mkdir(parents=True, exist_ok=True)
        # Closed by close() or, on failure, by __exit__, which also removes it; one that a killed encoder
        # left (gigabytes at WMT scale) the next writer of this entry removes (aiayn.files.temporary_file).
        self._raw = temporary_file(stem.parent, f"{stem.name}.raw")
        self._lengths: list[np.ndarray] = []

    def __enter__(self) -> EncodedTextWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.close()
        else:
            self._raw.close()
            os.unlink(self._raw.name)

    def append(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        self._raw.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int64))

    def close(self) -> None:
        self._raw.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        header = {
            "descr": np.lib.format.dtype_to_descr(self.dtype),
            "fortran_order": False,
            "shape": (int(offsets[-1]),),
        }

        def write_tokens(out: IO[bytes]) -> None:
            np.lib.format.write_array_header_1_0(out, header)
            with open(self._raw.name, "rb") as raw:
                shutil.copyfileobj(raw, out, 1 << 22)

        tokens_file, offsets_file = EncodedText.files(self.stem)
        try:
            atomic_write(tokens_file, write_tokens)
        finally:
            os.unlink(self._raw.name)
        atomic_write(offsets_file, lambda out: np.save(out, offsets))


class ParallelDataset(Dataset):
    """The sentence pairs ``indices`` of an encoded split."""

    def __init__(self, src: EncodedText, tgt: EncodedText, indices: np.ndarray) -> None:
        self.src, self.tgt, self.indices = src, tgt, np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def padded_lengths(self) -> np.ndarray:
        """Per pair (rows), its source + EOS and BOS + target lengths (columns): its length on each side of a
        batch; the longer one is its size (:class:`~aiayn.data.sampler.TokenBudgetBatchSampler`)."""
        return np.stack([self.src.lengths[self.indices], self.tgt.lengths[self.indices]], axis=1) + 1

    def __getitem__(self, i: int) -> tuple[int, np.ndarray, np.ndarray]:
        j = int(self.indices[i])
        return i, self.src[j], self.tgt[j]

    def __getitems__(self, positions: list[int]) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """The pairs of a batch, as :meth:`__getitem__` gives them one by one (a DataLoader fetches a batch
        through this when it exists). Slicing a memory map makes a memory map each time (2 µs); slicing a
        plain view of it and looking the offsets up at once reads 1300 pairs in 1.5 ms instead of 9."""
        rows = self.indices[positions]
        src, tgt = self.src.tokens.view(np.ndarray), self.tgt.tokens.view(np.ndarray)
        bounds = zip(
            positions,
            self.src.offsets[rows].tolist(),
            self.src.offsets[rows + 1].tolist(),
            self.tgt.offsets[rows].tolist(),
            self.tgt.offsets[rows + 1].tolist(),
            strict=True,
        )
        return [(i, src[a:b], tgt[c:d]) for i, a, b, c, d in bounds]


def _first_positions(lengths: np.ndarray, width: int) -> np.ndarray:
    """(rows, width) booleans: True at the first ``lengths[row]`` positions of each row."""
    return np.arange(width) < lengths[:, None]


class Collator:
    """Pads a list of pairs into the batch the model trains on.

    ``src`` gets EOS appended; the decoder reads ``tgt_in`` = BOS + target and predicts ``tgt_out`` =
    target + EOS (teacher forcing, §3 and Figure 1's "outputs shifted right"). With ``references``
    (raw target text by dataset position) evaluation batches carry the text that BLEU compares against.
    With ``shapes`` (:class:`~aiayn.data.sampler.BatchShapes`, the sampler's) each side is padded to the
    width of its batch's shape instead of to its longest sentence. ``packing``: the batch carries where
    its real tokens are (``source_rows``, ``offsets``), which only attention over packed sequences reads;
    a padded step would copy them to the device for nothing.

    Built with whole-array operations: a 25000-token batch of 1300 short pairs took 43 ms row by row.
    """

    def __init__(
        self,
        pad_id: int,
        bos_id: int,
        eos_id: int,
        references: Sequence[str] | None = None,
        shapes: BatchShapes | None = None,
        packing: bool = True,
    ) -> None:
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.references, self.shapes, self.packing = references, shapes, packing

    def __call__(self, items: list[tuple[int, np.ndarray, np.ndarray]]) -> dict[str, Any]:
        n = len(items)
        index = np.fromiter((i for i, _, _ in items), dtype=np.int64, count=n)
        # Real (non-padding) tokens per pair, source + EOS and target + EOS (the same count as BOS + target).
        lengths = np.empty((n, 2), dtype=np.int64)
        lengths[:, 0] = np.fromiter((len(s) for _, s, _ in items), dtype=np.int64, count=n)
        lengths[:, 1] = np.fromiter((len(t) for _, _, t in items), dtype=np.int64, count=n)
        lengths += 1
        src_len, tgt_len = lengths.max(axis=0).tolist()
        if self.shapes is not None:
            src_len, tgt_len = self.shapes.widths_of(n, src_len, tgt_len)
        rows = np.arange(n)
        src = np.full((n, src_len), self.pad_id, dtype=np.int64)
        # A boolean mask assigns in row-major order: the concatenated sentences land in their rows.
        src[_first_positions(lengths[:, 0] - 1, src_len)] = np.concatenate([s for _, s, _ in items])
        src[rows, lengths[:, 0] - 1] = self.eos_id
        target = np.concatenate([t for _, _, t in items])
        words = _first_positions(lengths[:, 1] - 1, tgt_len)
        tgt_in = np.full((n, tgt_len), self.pad_id, dtype=np.int64)
        tgt_in[:, 0] = self.bos_id
        tgt_in[:, 1:][words[:, :-1]] = target
        tgt_out = np.full((n, tgt_len), self.pad_id, dtype=np.int64)
        tgt_out[words] = target
        tgt_out[rows, lengths[:, 1] - 1] = self.eos_id
        batch: dict[str, Any] = {
            "src": torch.as_tensor(src),
            "tgt_in": torch.as_tensor(tgt_in),
            "tgt_out": torch.as_tensor(tgt_out),
            # NumPy, like the lengths: read on the host (test hypotheses by position, the tests' records),
            # never pinned or copied to the device.
            "index": index,
            # Kept in NumPy so that they stay on the CPU: throughput and MFU read them without waiting
            # for the GPU.
            "lengths": lengths,
            # Where the real target tokens sit in tgt_out flattened (row * tgt_len + position): the output
            # projection and the loss run on those rows only. Found here, on the CPU, so that the device
            # gets them with the batch instead of a nonzero() of its own that the host would wait for.
            "target_rows": torch.as_tensor(np.flatnonzero(_first_positions(lengths[:, 1], tgt_len))),
        }
        if self.packing:
            # The same for the source, and where each pair's real tokens start among the packed ones,
            # (source, target) x (B + 1): the layout of attention over packed sequences (aiayn.model.Packing).
            batch["source_rows"] = torch.as_tensor(np.flatnonzero(_first_positions(lengths[:, 0], src_len)))
            offsets = np.zeros((2, n + 1), dtype=np.int64)
            np.cumsum(lengths.T, axis=1, out=offsets[:, 1:])
            batch["offsets"] = torch.as_tensor(offsets)
        if self.references is not None:
            batch["references"] = [self.references[i] for i in index.tolist()]
        return batch
