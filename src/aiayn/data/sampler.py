"""The token-budget batch sampler: sentences bucketed by length, batches bounded in tokens (§5.1)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler


class SeededOrder(Sampler[int]):
    """A permutation of ``range(n)`` fixed by (seed, epoch), or the identity when not shuffling.

    Lightning calls ``set_epoch`` on a batch sampler's ``sampler``, which is how this reaches
    :class:`TokenBudgetBatchSampler` at every epoch.
    """

    def __init__(self, n: int, seed: int = 0, shuffle: bool = True) -> None:
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.n))
        return iter(torch.randperm(self.n, generator=self.generator()).tolist())

    def __len__(self) -> int:
        return self.n


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Batches of sentence indices, each at most ``max_tokens`` tokens *including padding*.

    A sentence pair's size is the longer of its source and target; a batch of ``n`` pairs whose
    largest size is ``m`` costs ``n * m`` tokens on either side. Sentences are ordered by size (ties
    broken by the seeded permutation) and packed greedily, so batches hold similar lengths and waste
    little padding; the order of the batches is then shuffled. Everything depends only on
    (seed, epoch): two runs with the same seed see the same batches in the same order.
    """

    def __init__(self, sizes: Sequence[int] | np.ndarray, max_tokens: int, seed: int = 0, shuffle: bool = True) -> None:
        self.sizes = np.asarray(sizes, dtype=np.int64)
        if self.sizes.size == 0:
            raise ValueError("cannot batch an empty split")
        longest = int(self.sizes.max())
        if longest > max_tokens:
            raise ValueError(
                f"data.max_tokens={max_tokens} is smaller than the longest sentence ({longest} tokens); "
                "raise data.max_tokens or lower data.max_len"
            )
        self.max_tokens = max_tokens
        self.sampler = SeededOrder(len(self.sizes), seed, shuffle)
        self._num_batches = len(self._pack(np.arange(len(self.sizes))))

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def _pack(self, order: np.ndarray) -> list[list[int]]:
        # Stable sort by size: equal sizes keep the seeded order, so ties differ between epochs.
        order = order[np.argsort(self.sizes[order], kind="stable")]
        batches: list[list[int]] = []
        batch: list[int] = []
        longest = 0
        for index, size in zip(order.tolist(), self.sizes[order].tolist(), strict=True):
            if batch and (len(batch) + 1) * max(longest, size) > self.max_tokens:
                batches.append(batch)
                batch, longest = [], 0
            batch.append(index)
            longest = max(longest, size)
        batches.append(batch)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._pack(np.fromiter(self.sampler, dtype=np.int64, count=len(self.sizes)))
        if self.sampler.shuffle:
            permutation = torch.randperm(len(batches), generator=self.sampler.generator()).tolist()
            batches = [batches[i] for i in permutation]
        yield from batches

    def __len__(self) -> int:
        return self._num_batches
