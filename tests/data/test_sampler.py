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


def shards(sizes: np.ndarray, world: int, epoch: int = 0, **kwargs: object) -> list[list[list[int]]]:
    """Every rank's batches of one epoch."""
    samplers = [TokenBudgetBatchSampler(sizes, 500, seed=3, num_replicas=world, rank=r, **kwargs) for r in range(world)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return [list(sampler) for sampler in samplers]


@pytest.mark.parametrize("world", [2, 3, 8])
def test_training_ranks_get_disjoint_batches_equal_in_number(sizes: np.ndarray, world: int) -> None:
    total = len(TokenBudgetBatchSampler(sizes, 500, seed=3))
    for epoch in (0, 1):
        ranks = shards(sizes, world, epoch)
        assert {len(batches) for batches in ranks} == {total // world}
        assert all(
            len(TokenBudgetBatchSampler(sizes, 500, seed=3, num_replicas=world, rank=r)) == total // world
            for r in range(world)
        )
        seen = [i for batches in ranks for batch in batches for i in batch]
        assert len(seen) == len(set(seen))  # no pair twice in the epoch, on any rank
        # only the epoch's last total % world batches are left out, and not always the same ones
        assert len(seen) > len(sizes) - (world - 1) * 500 / 3
    left_out = [set(range(len(sizes))) - {i for b in ranks for batch in b for i in batch} for ranks in
                (shards(sizes, 3, 0), shards(sizes, 3, 1))]  # fmt: skip
    assert left_out[0] != left_out[1] or not left_out[0]


def test_the_sharded_order_is_the_single_process_order_dealt_out(sizes: np.ndarray) -> None:
    single = list(TokenBudgetBatchSampler(sizes, 500, seed=3))
    ranks = shards(sizes, 2)
    assert ranks[0] == single[0 : 2 * len(ranks[0]) : 2] and ranks[1] == single[1 : 2 * len(ranks[1]) : 2]
    assert shards(sizes, 2) == ranks  # deterministic from (seed, epoch)


def test_evaluation_shards_cover_every_pair_once(sizes: np.ndarray) -> None:
    ranks = shards(sizes, 3, shuffle=False, even=False)
    seen = sorted(i for batches in ranks for batch in batches for i in batch)
    assert seen == list(range(len(sizes)))


@pytest.mark.parametrize(("world", "resumed_world"), [(1, 1), (2, 2), (2, 4), (4, 1)])
def test_a_resumed_epoch_continues_with_the_next_unseen_batches(
    sizes: np.ndarray, world: int, resumed_world: int
) -> None:
    epoch, consumed = 2, 5
    ranks = shards(sizes, world, epoch)
    saver = TokenBudgetBatchSampler(sizes, 500, seed=3, num_replicas=world, rank=0)
    saver.set_epoch(epoch)
    state = saver.state_dict(consumed)  # each rank has used its first `consumed` batches
    seen = {i for batches in ranks for batch in batches[:consumed] for i in batch}
    resumed = []
    for rank in range(resumed_world):
        sampler = TokenBudgetBatchSampler(sizes, 500, seed=3, num_replicas=resumed_world, rank=rank)
        sampler.load_state_dict(state)
        resumed.append(list(sampler))
        sampler.set_epoch(epoch + 1)  # the next epoch is whole again
        assert len(list(sampler)) == len(sampler)
    rest = [i for batches in resumed for batch in batches for i in batch]
    assert not seen & set(rest) and len(rest) == len(set(rest))
    if resumed_world == world:  # the same batches as without the interruption
        assert resumed == [batches[consumed:] for batches in ranks]
    # a second save in the resumed epoch counts from where the first left off
    again = TokenBudgetBatchSampler(sizes, 500, seed=3, num_replicas=resumed_world, rank=0)
    again.load_state_dict(state)
    assert again.state_dict(consumed + 2)["position"] == consumed * world + 2 * resumed_world


def test_a_checkpoint_of_other_batching_restarts_the_epoch(sizes: np.ndarray) -> None:
    state = TokenBudgetBatchSampler(sizes, 500, seed=3).state_dict(4)
    other = TokenBudgetBatchSampler(sizes, 400, seed=3)
    other.load_state_dict(state)
    assert len(list(other)) == len(other)


@pytest.mark.parametrize(("world", "group"), [(1, 4), (2, 3), (8, 2)])
def test_an_epoch_holds_whole_optimizer_steps_of_accumulated_batches(sizes: np.ndarray, world: int, group: int) -> None:
    total = len(TokenBudgetBatchSampler(sizes, 500, seed=3))
    samplers = [
        TokenBudgetBatchSampler(sizes, 500, seed=3, num_replicas=world, rank=r, group=group) for r in range(world)
    ]
    lengths = {len(list(sampler)) for sampler in samplers} | {len(sampler) for sampler in samplers}
    assert lengths == {total // (world * group) * group}  # whole steps on every rank, as many as fit


@pytest.fixture
def pair_lengths() -> np.ndarray:
    """(source, target) lengths of translation-like pairs: the target within a few tokens of the source."""
    rng = np.random.default_rng(0)
    src = rng.integers(3, 40, size=4000)
    return np.stack([src, np.clip(src + rng.integers(-4, 5, size=src.size), 2, None)], axis=1)


def padding_fill(lengths: np.ndarray, batches: list[list[int]]) -> float:
    """Real tokens over padded tokens, both sides of every batch."""
    padded = sum(len(b) * lengths[b].max(axis=0).sum() for b in batches)
    return lengths.sum() / padded


def test_pairs_of_one_size_are_grouped_by_their_longer_side(pair_lengths: np.ndarray) -> None:
    sizes = pair_lengths.max(axis=1)
    by_size = list(TokenBudgetBatchSampler(sizes, 500, seed=1))
    by_side = list(TokenBudgetBatchSampler(pair_lengths, 500, seed=1))
    assert len(by_side) == len(by_size)  # the same budget on the same sizes: as many batches
    assert all(len(b) * sizes[b].max() <= 500 for b in by_side)
    assert sorted(i for b in by_side for i in b) == list(range(len(sizes)))
    assert padding_fill(pair_lengths, by_side) > padding_fill(pair_lengths, by_size) + 0.01  # 0.947 -> 0.959
    # ties are still broken by the seed: another epoch, other batches (not only in another order)
    sampler = TokenBudgetBatchSampler(pair_lengths, 500, seed=1)
    sampler.set_epoch(1)
    assert {frozenset(b) for b in sampler} != {frozenset(b) for b in by_side}


def test_a_checkpoint_of_batches_by_size_alone_finishes_its_epoch_in_them(pair_lengths: np.ndarray) -> None:
    """An aiayn that batched by size alone saved positions in its own batches (and the training loop counts
    the batches taken): that epoch goes on in them, saved again as such; the next is grouped by side."""
    by_size = TokenBudgetBatchSampler(pair_lengths.max(axis=1), 500, seed=3)
    by_size.set_epoch(2)
    old_epoch = list(by_size)
    grouped = TokenBudgetBatchSampler(pair_lengths, 500, seed=3)
    grouped.load_state_dict(by_size.state_dict(4))
    assert list(grouped) == old_epoch[4:]
    again = TokenBudgetBatchSampler(pair_lengths, 500, seed=3)
    again.load_state_dict(grouped.state_dict(6))
    assert list(again) == old_epoch[6:]
    fresh = TokenBudgetBatchSampler(pair_lengths, 500, seed=3)
    for sampler in (grouped, fresh):
        sampler.set_epoch(3)
    assert list(grouped) == list(fresh) and "by_side" in grouped.state_dict(0)
    # the other way round, side-grouped positions mean nothing in batches by size: that epoch restarts
    by_size.load_state_dict(fresh.state_dict(4))
    assert len(list(by_size)) == len(by_size)
