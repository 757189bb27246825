"""The token-budget batch sampler."""

from __future__ import annotations

import numpy as np
import pytest

from aiayn.data.sampler import TokenBudgetBatchSampler


@pytest.fixture
def sizes() -> np.ndarray:
    return np.random.default_rng(0).integers(3, 60, size=2000)


def test_every_batch_fits_the_budget_including_padding(sizes: np.ndarray) -> None:
    sampler = TokenBudgetBatchSampler(sizes, max_tokens=500, seed=1)
    batches = list(sampler)
    assert all(len(b) * sizes[b].max() <= 500 for b in batches)
    assert len(batches) == len(sampler)


def test_every_sentence_appears_exactly_once_per_epoch(sizes: np.ndarray) -> None:
    sampler = TokenBudgetBatchSampler(sizes, max_tokens=500, seed=1)
    for epoch in (0, 3):
        sampler.set_epoch(epoch)
        seen = np.concatenate([np.asarray(b) for b in sampler])
        assert sorted(seen.tolist()) == list(range(len(sizes)))


def test_batches_group_similar_lengths(sizes: np.ndarray) -> None:
    batches = list(TokenBudgetBatchSampler(sizes, max_tokens=500, seed=1))
    padded = sum(len(b) * sizes[b].max() for b in batches)
    assert sizes.sum() / padded > 0.95  # under 5% of the tokens are padding


def test_order_is_deterministic_from_seed_and_epoch(sizes: np.ndarray) -> None:
    def epoch_batches(seed: int, epoch: int) -> list[list[int]]:
        sampler = TokenBudgetBatchSampler(sizes, max_tokens=500, seed=seed)
        sampler.sampler.set_epoch(epoch)  # the hook Lightning calls
        return list(sampler)

    assert epoch_batches(1, 2) == epoch_batches(1, 2)
    assert epoch_batches(1, 2) != epoch_batches(1, 3)
    assert epoch_batches(1, 2) != epoch_batches(2, 2)


def test_without_shuffling_batches_come_sorted_by_length(sizes: np.ndarray) -> None:
    batches = list(TokenBudgetBatchSampler(sizes, max_tokens=500, shuffle=False))
    longest = [sizes[b].max() for b in batches]
    assert longest == sorted(longest)


def test_a_sentence_longer_than_the_budget_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"data\.max_tokens=50"):
        TokenBudgetBatchSampler([10, 80], max_tokens=50)
