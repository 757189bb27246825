"""Beam search (§6.1): the cache, the length penalty, the length limit, exactness on tiny problems."""

from __future__ import annotations

import math

import pytest
import torch

from aiayn.model import DecodingOptions, Transformer, TransformerConfig, beam_search, greedy_decode, length_penalty
from aiayn.model.beam_search import SENTENCE_MULTIPLE
from helpers.reference_search import BOS, EOS, biased_model, exhaustive_best, recomputing_greedy, sequence_log_prob


def random_model(positional: str = "sinusoidal", vocab: int = 40, sharpen: float = 1.0, seed: int = 1) -> Transformer:
    torch.manual_seed(seed)
    cfg = TransformerConfig(
        vocab_size=vocab, n_layers=2, d_model=32, d_ff=64, n_heads=2, d_k=8, d_v=12, positional=positional
    )
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.output_proj.weight.mul_(sharpen)  # larger logits: peaked, more varied distributions
    return model


def padded_sources(vocab: int, lengths: list[int], seed: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    src = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, length in enumerate(lengths):
        src[row, :length] = torch.randint(4, vocab, (length,), generator=generator)
    return src


@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "none", "rope"])
def test_cached_beam_search_equals_recomputing_the_prefix(positional: str) -> None:
    model = random_model(positional, sharpen=3.0)
    src = padded_sources(40, [9, 4, 7, 1, 6])
    cached = beam_search(model, src, BOS, EOS, DecodingOptions(beam_size=4, alpha=0.6, max_len_offset=6))
    recomputed = beam_search(
        model, src, BOS, EOS, DecodingOptions(beam_size=4, alpha=0.6, max_len_offset=6), use_cache=False
    )
    assert [h.tokens for h in cached] == [h.tokens for h in recomputed]
    for fast, slow in zip(cached, recomputed, strict=True):
        assert fast.score == pytest.approx(slow.score, abs=1e-4)
        assert fast.log_prob == pytest.approx(slow.log_prob, abs=1e-4)


def test_a_sentence_gets_the_same_translation_alone_and_in_a_padded_batch() -> None:
    model = random_model(sharpen=3.0)
    src = padded_sources(40, [3, 8, 5, 2])
    batched = beam_search(model, src, BOS, EOS, DecodingOptions(beam_size=3, max_len_offset=5))
    for row, hypothesis in zip(src, batched, strict=True):
        alone = beam_search(model, row[row.ne(0)][None], BOS, EOS, DecodingOptions(beam_size=3, max_len_offset=5))[0]
        assert alone.tokens == hypothesis.tokens
        assert alone.score == pytest.approx(hypothesis.score, abs=1e-4)


@pytest.mark.parametrize("beam", [1, 4])
def test_finished_sentences_leave_the_batch_in_multiples_and_change_no_translation(beam: int) -> None:
    """37 sentences of 1-12 tokens: the decoder's batch shrinks through multiples of SENTENCE_MULTIPLE
    sentences only, and every sentence ends as it does alone (the finished ones riding along add nothing)."""
    model = random_model(sharpen=3.0)
    lengths = [int(n) for n in torch.randint(1, 13, (37,), generator=torch.Generator().manual_seed(3))]
    src = padded_sources(40, lengths)
    options = DecodingOptions(beam_size=beam, alpha=0.6, max_len_offset=8)
    sizes: list[int] = []
    hook = model.output_proj.register_forward_pre_hook(lambda _, args: sizes.append(args[0].size(0) // beam))
    batched = beam_search(model, src, BOS, EOS, options)
    hook.remove()
    assert sizes[0] == 37 and len(set(sizes)) > 2  # sentences did leave, in several groups
    assert all(size % SENTENCE_MULTIPLE == 0 for size in sizes[1:] if size != 37)
    for row, hypothesis in zip(src, batched, strict=True):
        alone = beam_search(model, row[row.ne(0)][None], BOS, EOS, options)[0]
        assert alone.tokens == hypothesis.tokens
        assert alone.score == pytest.approx(hypothesis.score, abs=1e-4)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.5])
def test_beam_size_one_is_greedy_decoding(alpha: float) -> None:
    model = biased_model(vocab=12, eos_bonus=2.0, sharpen=2.0)
    src = padded_sources(12, [5, 2, 7, 4, 3, 6, 8, 9], seed=5)
    expected = recomputing_greedy(model, src, max_len_offset=8)
    # not a degenerate case: sentences end at the length limit, before it by EOS, and at once
    limits = [int(row.ne(0).sum()) + 8 for row in src]
    ends = [len(tokens) for tokens in expected]
    assert set(ends) & set(limits) and 0 in ends
    assert any(0 < end < limit for end, limit in zip(ends, limits, strict=True))
    found = beam_search(model, src, BOS, EOS, DecodingOptions(beam_size=1, alpha=alpha, max_len_offset=8))
    assert [h.tokens for h in found] == expected
    assert greedy_decode(model, src, BOS, EOS, max_len_offset=8) == expected


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0, 5.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_large_beam_finds_the_exhaustive_optimum(alpha: float, seed: int) -> None:
    # Vocabulary: PAD, UNK, BOS, EOS and two words; UNK and the words may be generated (3 choices).
    # With at most 3 + 1 tokens there are 3^4 = 81 live prefixes at most, all inside a beam of 96.
    # α = 2 and 5 reward length strongly: a search that stopped once some hypothesis had finished, or
    # that bounded live beams by a length penalty shorter than the longest reachable, misses the winners.
    model = random_model(vocab=6, sharpen=4.0, seed=seed)
    src = torch.tensor([[4, 5, 4], [5, 0, 0], [4, 4, 0]])
    found = beam_search(model, src, BOS, EOS, DecodingOptions(beam_size=96, alpha=alpha, max_len_offset=1))
    for row, hypothesis in zip(src, found, strict=True):
        tokens, score = exhaustive_best(model, row, max_len_offset=1, alpha=alpha)
        assert hypothesis.tokens == tokens
        assert hypothesis.score == pytest.approx(score, abs=1e-4)


def test_the_length_penalty_follows_gnmt() -> None:
    assert length_penalty(1.0, 0.6) == pytest.approx(1.0)
    assert length_penalty(10.0, 0.6) == pytest.approx((15 / 6) ** 0.6)
    assert length_penalty(25.0, 2.0) == pytest.approx(25.0)
    assert length_penalty(7.0, 0.0) == 1.0
    model = random_model(sharpen=3.0)
    src = padded_sources(40, [6, 3])
    for row, hypothesis in zip(
        src, beam_search(model, src, BOS, EOS, DecodingOptions(beam_size=4, alpha=0.6)), strict=True
    ):
        log_prob = sequence_log_prob(model, row, hypothesis.tokens)
        assert hypothesis.log_prob == pytest.approx(log_prob, abs=1e-4)
        # |Y| counts the emitted tokens including EOS
        assert hypothesis.score == pytest.approx(log_prob / ((5 + len(hypothesis.tokens) + 1) / 6) ** 0.6, abs=1e-4)


def test_outputs_stop_at_source_length_plus_the_offset() -> None:
    model = random_model()
    with torch.no_grad():
        # EOS's logit is 0 while the others are large and random: only the length limit ends a sentence
        model.output_proj.weight.mul_(10)
        model.output_proj.weight[EOS].zero_()
    src = padded_sources(40, [6, 6, 2])
    for offset in (0, 3):
        hypotheses = beam_search(model, src, BOS, EOS, DecodingOptions(beam_size=4, max_len_offset=offset))
        assert [len(h.tokens) for h in hypotheses] == [6 + offset, 6 + offset, 2 + offset]


def test_the_search_stops_once_no_live_beam_can_win() -> None:
    model = biased_model(vocab=40, eos_bonus=30.0)
    src = padded_sources(40, [8, 5, 8])
    hypotheses = beam_search(model, src, BOS, EOS, DecodingOptions(beam_size=4, alpha=0.6, max_len_offset=50))
    # EOS first is almost certain; every live beam is already e^-30 behind and can only fall further.
    assert [h.tokens for h in hypotheses] == [[], [], []]
    assert model.calls == 1
    assert all(math.isclose(h.score, h.log_prob) for h in hypotheses)  # lp(1) = 1


def test_outputs_never_outgrow_the_position_table() -> None:
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=40, n_layers=1, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8, positional="learned", max_positions=9
    )
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.output_proj.weight[EOS].zero_()  # as above: only the limit ends a sentence
        model.output_proj.weight.mul_(10)
    src = padded_sources(40, [6, 2])
    hypotheses = beam_search(model, src, BOS, EOS, DecodingOptions(beam_size=3, max_len_offset=50))
    # BOS + 8 tokens fill the 9 learned positions; the second sentence's own limit (2 + 2) comes first
    assert [len(h.tokens) for h in hypotheses] == [8, 8]
    assert [
        len(h.tokens) for h in beam_search(model, src, BOS, EOS, DecodingOptions(beam_size=3, max_len_offset=2))
    ] == [8, 4]


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), -0.1])
def test_a_length_penalty_that_is_not_a_finite_non_negative_number_is_refused(alpha: float) -> None:
    with pytest.raises(ValueError, match=r"alpha=\S+ must be a number >= 0"):
        beam_search(random_model(), padded_sources(40, [3]), BOS, EOS, DecodingOptions(beam_size=2, alpha=alpha))
