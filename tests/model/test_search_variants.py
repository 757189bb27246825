"""What research asks of the decoder beyond §6.1: the n best hypotheses, ensembles, the power length
penalty, a minimum length, no repeated n-grams, and seeded sampling; each checked against a reference
(exhaustive search, the single model, the model's own distribution)."""

from __future__ import annotations

import itertools

import pytest
import torch

from aiayn.model import DecodingOptions, Ensemble, Transformer, TransformerConfig, beam_search, nbest_search, sample
from aiayn.model.decoding_options import repeated_ngram_ends
from helpers.reference_search import BOS, EOS, biased_model, exhaustive_ranking, sequence_log_prob


def random_model(vocab: int = 40, sharpen: float = 1.0, seed: int = 1, d_model: int = 32) -> Transformer:
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=vocab, n_layers=2, d_model=d_model, d_ff=64, n_heads=2, d_k=8, d_v=12)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.output_proj.weight.mul_(sharpen)  # larger logits: peaked, more varied distributions
    return model


def sources(vocab: int, lengths: list[int], seed: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    src = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, length in enumerate(lengths):
        src[row, :length] = torch.randint(4, vocab, (length,), generator=generator)
    return src


@pytest.mark.parametrize(
    ("alpha", "kind", "members", "mean"),
    [(0.0, "gnmt", 1, "log_prob"), (2.0, "gnmt", 1, "log_prob"), (1.0, "power", 1, "log_prob"),
     (0.6, "gnmt", 2, "log_prob"), (0.6, "gnmt", 3, "prob")],
)  # fmt: skip
def test_a_large_beam_returns_the_exhaustive_k_best_in_order(alpha: float, kind: str, members: int, mean: str) -> None:
    """Also for an ensemble, whose members combine by their log-probabilities' mean or, as fairseq's, by
    their probabilities' (the reference sums the log of the mean of the members' step probabilities)."""
    # 3 allowed tokens, at most 3 + 1 of them: every prefix fits in a beam of 96, so the beam reaches all
    models = [random_model(vocab=6, sharpen=4.0, seed=seed) for seed in range(members)]
    src = torch.tensor([[4, 5, 4], [5, 0, 0]])
    options = DecodingOptions(beam_size=96, alpha=alpha, length_penalty=kind, max_len_offset=1, ensemble=mean)
    found = nbest_search(models, src, BOS, EOS, options, nbest=5)
    for row, hypotheses in zip(src, found, strict=True):
        best = exhaustive_ranking(models, row, max_len_offset=1, alpha=alpha, kind=kind, mean=mean)[:5]
        assert [h.tokens for h in hypotheses] == [tokens for tokens, _ in best]
        assert [h.score for h in hypotheses] == pytest.approx([score for _, score in best], abs=1e-4)


def test_the_first_of_the_n_best_is_the_plain_search_and_the_rest_follow_in_order() -> None:
    model = random_model(sharpen=3.0)
    src = sources(40, [7, 3, 5])
    options = DecodingOptions(beam_size=5, alpha=0.6)
    plain = beam_search(model, src, BOS, EOS, options)
    found = nbest_search(model, src, BOS, EOS, options, nbest=5)
    for one, hypotheses in zip(plain, found, strict=True):
        assert hypotheses[0] == one and len(hypotheses) == 5
        assert [h.score for h in hypotheses] == sorted((h.score for h in hypotheses), reverse=True)
        assert len({tuple(h.tokens) for h in hypotheses}) == 5
    with pytest.raises(ValueError, match=r"nbest=6 must be a whole number from 1 to the beam size \(5\)"):
        nbest_search(model, src, BOS, EOS, options, nbest=6)


def test_an_ensemble_of_one_or_of_copies_is_the_model() -> None:
    model = random_model(sharpen=3.0)
    src = sources(40, [6, 4])
    options = DecodingOptions(beam_size=4, alpha=0.6, max_len_offset=8)
    alone = nbest_search(model, src, BOS, EOS, options, nbest=3)
    for members in ([model], [model, model]):
        together = nbest_search(members, src, BOS, EOS, options, nbest=3)
        assert [[h.tokens for h in hs] for hs in together] == [[h.tokens for h in hs] for hs in alone]
        for ours, single in zip(itertools.chain(*together), itertools.chain(*alone), strict=True):
            assert ours.score == pytest.approx(single.score, abs=1e-5)


def test_an_ensemble_of_models_of_other_shapes_decodes_and_one_vocabulary_is_required() -> None:
    small, wide = random_model(sharpen=3.0, seed=1), random_model(sharpen=3.0, seed=2, d_model=48)
    src = sources(40, [5, 3])
    (first, _) = nbest_search([small, wide], src, BOS, EOS, DecodingOptions(beam_size=3), nbest=1)
    expected = (
        sequence_log_prob(small, src[0], first[0].tokens) + sequence_log_prob(wide, src[0], first[0].tokens)
    ) / 2
    assert first[0].log_prob == pytest.approx(expected, abs=1e-4)
    with pytest.raises(ValueError, match="must share one vocabulary"):
        Ensemble([small, random_model(vocab=41)])


def test_the_power_penalty_divides_by_the_length_with_eos() -> None:
    model = random_model(sharpen=3.0)
    src = sources(40, [6, 3])
    for h, row in zip(
        beam_search(model, src, BOS, EOS, DecodingOptions(alpha=1.0, length_penalty="power")), src, strict=True
    ):
        assert h.score == pytest.approx(sequence_log_prob(model, row, h.tokens) / (len(h.tokens) + 1), abs=1e-4)


@pytest.mark.parametrize("options", [DecodingOptions(beam_size=4), DecodingOptions(sample=True, beam_size=1)])
def test_a_minimum_length_holds_off_eos(options: DecodingOptions) -> None:
    model, src = biased_model(vocab=40, eos_bonus=4.0, sharpen=3.0), sources(40, [6, 3, 5])  # EOS first, mostly
    short = [h.tokens for hs in nbest_search(model, src, BOS, EOS, DecodingOptions(beam_size=4)) for h in hs]
    assert min(len(tokens) for tokens in short) < 3
    longer = DecodingOptions(**{**options.to_dict(), "min_len": 3})
    found = (
        sample(model, src, BOS, EOS, longer, 1, torch.arange(3))
        if longer.sample
        else nbest_search(model, src, BOS, EOS, longer)
    )
    assert all(len(h.tokens) >= 3 for hs in found for h in hs)


def repeats(tokens: list[int], n: int) -> bool:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) != len(set(grams))


def test_no_ngram_is_repeated_when_asked() -> None:
    model = random_model(sharpen=6.0)
    with torch.no_grad():
        model.output_proj.weight[EOS].zero_()  # only the length limit ends: long outputs that repeat
    src = sources(40, [8, 6, 7])
    plain = [h.tokens for h in beam_search(model, src, BOS, EOS, DecodingOptions(max_len_offset=10))]
    assert any(repeats(tokens, 2) for tokens in plain)
    for n in (1, 2, 3):
        found = beam_search(model, src, BOS, EOS, DecodingOptions(max_len_offset=10, no_repeat_ngram=n))
        assert not any(repeats(h.tokens, n) for h in found)
        assert all(len(h.tokens) > 0 for h in found)


def test_repeated_ngram_ends_are_the_tokens_that_followed_the_last_n_minus_1_before() -> None:
    generated = torch.tensor([[5, 6, 7, 5, 6], [4, 4, 4, 4, 4]])
    banned = repeated_ngram_ends(generated, 3, 10)  # row 0 ends in 5 6, once followed by 7; row 1 in 4 4
    assert banned[0].nonzero().flatten().tolist() == [7] and banned[1].nonzero().flatten().tolist() == [4]
    assert repeated_ngram_ends(generated, 1, 10)[0].nonzero().flatten().tolist() == [5, 6, 7]


SAMPLING = DecodingOptions(sample=True, beam_size=1, temperature=1.5, max_len_offset=6)


def test_samples_depend_on_the_seed_and_the_sentences_number_only() -> None:
    model = random_model(sharpen=2.0)
    src = sources(40, [6, 3, 5, 4])
    numbers = torch.tensor([10, 11, 12, 13])
    together = sample(model, src, BOS, EOS, SAMPLING, seed=7, sentences=numbers, n=3)
    again = sample(model, src, BOS, EOS, SAMPLING, seed=7, sentences=numbers, n=3)
    assert [[h.tokens for h in hs] for hs in together] == [[h.tokens for h in hs] for hs in again]
    for i in (3, 0):  # alone, in a batch of one without padding, and reordered with another sentence
        alone = sample(model, src[i : i + 1, : int(src[i].ne(0).sum())], BOS, EOS, SAMPLING, 7, numbers[i : i + 1], 3)
        assert [h.tokens for h in alone[0]] == [h.tokens for h in together[i]]
    pair = sample(model, src[[2, 1]], BOS, EOS, SAMPLING, seed=7, sentences=numbers[[2, 1]], n=3)
    assert [[h.tokens for h in hs] for hs in pair] == [[h.tokens for h in hs] for hs in (together[2], together[1])]
    other_seed = sample(model, src, BOS, EOS, SAMPLING, seed=8, sentences=numbers, n=3)
    assert [[h.tokens for h in hs] for hs in other_seed] != [[h.tokens for h in hs] for hs in together]
    for hs, row in zip(together, src, strict=True):
        for h in hs:  # each sample's log-probability is the model's, before temperature
            assert h.log_prob == pytest.approx(sequence_log_prob(model, row, h.tokens), abs=1e-4)


def first_token_frequencies(options: DecodingOptions, draws: int = 3000) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each first token is drawn, and the model's distribution of the first token."""
    model = random_model(vocab=12, sharpen=2.0)
    src = sources(12, [5])
    found = sample(model, src, BOS, EOS, options, seed=3, sentences=torch.tensor([0]), n=draws)
    counts = torch.zeros(12)
    for h in found[0]:
        counts[h.tokens[0] if h.tokens else EOS] += 1
    with torch.no_grad():
        memory, padding = model.encode(src)
        logits = model.decode(torch.tensor([[BOS]]), memory, padding)[0, -1]
    logits[[0, BOS]] = float("-inf")
    return counts / draws, logits


def test_samples_follow_the_models_distribution_sharpened_and_cut_as_asked() -> None:
    frequencies, logits = first_token_frequencies(SAMPLING)
    expected = (logits / 1.5).softmax(-1)
    assert (frequencies - expected).abs().max() < 0.04  # 3000 draws: a standard error of at most 0.009
    top3 = logits.topk(3).indices
    frequencies, _ = first_token_frequencies(DecodingOptions(sample=True, beam_size=1, top_k=3, max_len_offset=6))
    assert set(frequencies.nonzero().flatten().tolist()) <= set(top3.tolist())
    probs = logits.softmax(-1).sort(descending=True)
    nucleus = probs.indices[: int((probs.values.cumsum(0) < 0.6).sum()) + 1]
    frequencies, _ = first_token_frequencies(DecodingOptions(sample=True, beam_size=1, top_p=0.6, max_len_offset=6))
    assert set(frequencies.nonzero().flatten().tolist()) == set(nucleus.tolist())


def test_sampling_from_the_top_token_only_is_greedy_decoding() -> None:
    model, src = random_model(sharpen=2.0), sources(40, [6, 3, 5])
    greedy = beam_search(model, src, BOS, EOS, DecodingOptions(beam_size=1, max_len_offset=6))
    top1 = DecodingOptions(sample=True, beam_size=1, top_k=1, max_len_offset=6)
    assert [hs[0].tokens for hs in sample(model, src, BOS, EOS, top1, 0, torch.arange(3))] == [h.tokens for h in greedy]


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("length_penalty", "linear", "must be gnmt"),
        ("min_len", -1, "must be a whole number of tokens"),
        ("no_repeat_ngram", 1.5, "must be a whole number >= 0"),
        ("temperature", 0, "must be a number > 0"),
        ("top_k", -2, "must be a whole number >= 0"),
        ("top_p", 0, r"must be a number in \(0, 1\]"),
        ("beam_size", 4, "must be 1 when sampling"),
    ],
)
def test_decoding_options_refuse_what_cannot_work(field: str, value: object, says: str) -> None:
    sampling = {"sample": True, "beam_size": 1} if field != "beam_size" else {"sample": True}
    with pytest.raises(ValueError, match=f"^{field}={value}.* {says}"):
        DecodingOptions(**{**sampling, field: value})
