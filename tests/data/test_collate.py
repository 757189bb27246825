"""The collator's whole-array construction against the row-by-row one it replaced, and batch reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from aiayn.data.dataset import Collator, EncodedText, EncodedTextWriter, ParallelDataset

PAD, BOS, EOS = 0, 2, 3


def row_by_row(items: list[tuple[int, np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """The batch as the collator built it before, one row at a time (aiayn up to aba6874)."""
    n = len(items)
    src_len = max(len(s) for _, s, _ in items) + 1
    tgt_len = max(len(t) for _, _, t in items) + 1
    src = torch.full((n, src_len), PAD, dtype=torch.long)
    tgt_in = torch.full((n, tgt_len), PAD, dtype=torch.long)
    tgt_out = torch.full((n, tgt_len), PAD, dtype=torch.long)
    for row, (_, s, t) in enumerate(items):
        src[row, : len(s)] = torch.from_numpy(s.astype(np.int64))
        src[row, len(s)] = EOS
        tgt_in[row, 0] = BOS
        tgt_in[row, 1 : len(t) + 1] = torch.from_numpy(t.astype(np.int64))
        tgt_out[row, : len(t)] = tgt_in[row, 1 : len(t) + 1]
        tgt_out[row, len(t)] = EOS
    lengths = np.array([(len(s) + 1, len(t) + 1) for _, s, t in items], dtype=np.int64)

    def real_rows(counts: np.ndarray, width: int) -> torch.Tensor:
        return (torch.arange(width) < torch.as_tensor(counts)[:, None]).flatten().nonzero().squeeze(1)

    return {
        "src": src,
        "tgt_in": tgt_in,
        "tgt_out": tgt_out,
        "index": torch.tensor([i for i, _, _ in items], dtype=torch.long),
        "lengths": lengths,
        "target_rows": real_rows(lengths[:, 1], tgt_len),
        "source_rows": real_rows(lengths[:, 0], src_len),
        "offsets": torch.as_tensor(np.concatenate([np.zeros((2, 1), dtype=np.int64), lengths.T.cumsum(1)], 1)),
    }


def random_items(rng: np.random.Generator, rows: int, dtype: type) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Pairs of random ids and lengths 0-60 (empty sentences included), at random dataset positions."""
    positions = rng.choice(100_000, size=rows, replace=False)
    return [
        (
            int(i),
            rng.integers(4, 30000, rng.integers(0, 61)).astype(dtype),
            rng.integers(4, 30000, rng.integers(0, 61)).astype(dtype),
        )
        for i in positions
    ]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_whole_array_batches_equal_the_row_by_row_ones(dtype: type) -> None:
    rng = np.random.default_rng(0)
    for rows in (1, 2, 7, 64, 300):
        items = random_items(rng, rows, dtype)
        made, expected = Collator(PAD, BOS, EOS)(items), row_by_row(items)
        assert made.keys() == expected.keys()
        for key in ("src", "tgt_in", "tgt_out", "target_rows", "source_rows", "offsets"):
            assert made[key].dtype == expected[key].dtype == torch.long, key
            assert torch.equal(made[key], expected[key]), key
        assert made["lengths"].tolist() == expected["lengths"].tolist()
        assert made["index"].tolist() == expected["index"].tolist()


def test_a_padded_step_gets_no_packing_and_the_positions_stay_on_the_host() -> None:
    items = random_items(np.random.default_rng(1), 5, np.uint16)
    batch = Collator(PAD, BOS, EOS, references=[f"line {i}" for i in range(100_000)], packing=False)(items)
    assert "source_rows" not in batch and "offsets" not in batch
    # NumPy: neither pinned nor copied to the device; what reads them reads them on the host
    assert isinstance(batch["index"], np.ndarray) and isinstance(batch["lengths"], np.ndarray)
    assert batch["references"] == [f"line {i}" for i, _, _ in items]


def test_a_batch_read_at_once_is_its_pairs_read_one_by_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    for lang in ("en", "de"):
        lengths = rng.integers(0, 40, 500)
        with EncodedTextWriter(tmp_path / f"train.{lang}", np.dtype(np.uint16)) as writer:
            writer.append(rng.integers(0, 30000, int(lengths.sum())), lengths)
    src, tgt = (EncodedText.load(tmp_path / f"train.{lang}") for lang in ("en", "de"))
    assert isinstance(src.tokens, np.memmap)
    dataset = ParallelDataset(src, tgt, rng.permutation(500)[:300])
    positions = rng.permutation(300)[:120].tolist()
    at_once, one_by_one = dataset.__getitems__(positions), [dataset[i] for i in positions]
    assert [i for i, _, _ in at_once] == [i for i, _, _ in one_by_one] == positions
    for (_, s, t), (_, s1, t1) in zip(at_once, one_by_one, strict=True):
        assert s.tolist() == s1.tolist() and t.tolist() == t1.tolist() and s.dtype == s1.dtype == np.uint16
    # the DataLoader fetches a batch through it, not pair by pair
    monkeypatch.setattr(ParallelDataset, "__getitem__", lambda *_: pytest.fail("read one by one"))
    loader = DataLoader(dataset, batch_sampler=[positions], collate_fn=Collator(PAD, BOS, EOS))
    assert torch.equal(next(iter(loader))["src"], Collator(PAD, BOS, EOS)(one_by_one)["src"])
