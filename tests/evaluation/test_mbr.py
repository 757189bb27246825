"""Minimum Bayes risk decoding: the candidate with the highest mean sentence utility against all candidates,
checked against a brute-force reference of the definition, and through the translator, whose candidates are
the beam's n best and the draws of sampling."""

from __future__ import annotations

import random

import pytest
import sacrebleu
import torch

from aiayn.config.tool_plans import tool_keys
from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import ConfigError
from aiayn.evaluation.mbr import mbr_ranked
from aiayn.evaluation.translator import Candidate, Translator
from aiayn.model import DecodingOptions, Transformer, TransformerConfig
from helpers.word_corpus import WORDS, word_tokenizer


def brute_force(texts: list[str], utility: str) -> list[tuple[str, float]]:
    """Every candidate (duplicates too) with its mean utility against every candidate, as the definition
    reads; best first, the first of equal ones first."""
    bleu = sacrebleu.BLEU(effective_order=True)
    score = sacrebleu.sentence_chrf if utility == "chrf" else bleu.sentence_score
    means = [(text, sum(score(text, [other]).score for other in texts) / len(texts)) for text in texts]
    ranked: list[tuple[str, float]] = []
    for text, mean in sorted(means, key=lambda item: -item[1]):
        if text not in [seen for seen, _ in ranked]:
            ranked.append((text, mean))
    return ranked


@pytest.mark.parametrize("utility", ["chrf", "bleu"])
@pytest.mark.parametrize("seed", range(6))
def test_the_ranking_is_the_definitions(utility: str, seed: int) -> None:
    rng = random.Random(seed)
    pool = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))) for _ in range(5)]
    texts = [rng.choice(pool) for _ in range(rng.randint(1, 12))]  # draws repeat: a repeated text weighs more
    candidates = [Candidate(text, -float(i), -float(i)) for i, text in enumerate(texts)]
    ranked = mbr_ranked(candidates, utility)
    expected = brute_force(texts, utility)
    assert [c.score for c in ranked] == pytest.approx([mean for _, mean in expected], abs=1e-9)
    best = max(mean for _, mean in expected)
    assert ranked[0].text in [text for text, mean in expected if mean == pytest.approx(best, abs=1e-9)]
    assert all(c.log_prob == -float(texts.index(c.text)) for c in ranked)  # the first find's log-probability


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return word_tokenizer(tmp_path_factory.mktemp("spm"))


def test_the_translator_picks_among_the_beams_best_and_its_draws(tokenizer: Tokenizer) -> None:
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=tokenizer.vocab_size, n_layers=1, d_model=32, d_ff=64, n_heads=2, d_k=16,
                            d_v=16, max_positions=64)  # fmt: skip
    model = Transformer(cfg)
    lines = ["a man runs in the park", "the red ball", "", "a dog walks near the blue house with a woman"]
    base = {"beam_size": 4, "max_len_offset": 5}
    mbr = Translator(model, tokenizer, DecodingOptions(**base, mbr="chrf", mbr_nbest=3, mbr_samples=4), nbest=2)
    beams = Translator(model, tokenizer, DecodingOptions(**base), nbest=3).candidates(lines)
    sampling = DecodingOptions(**base | {"beam_size": 1}, sample=True)
    draws = Translator(model, tokenizer, sampling, nbest=4).candidates(lines)
    for line, found, beam, drawn in zip(lines, mbr.candidates(lines), beams, draws, strict=True):
        if not line:
            assert found == []
            continue
        expected = brute_force([c.text for c in [*beam, *drawn]], "chrf")
        assert [c.score for c in found] == pytest.approx([mean for _, mean in expected[:2]], abs=1e-9)
        assert found[0].text in [text for text, mean in expected if mean == pytest.approx(expected[0][1], abs=1e-9)]
    assert mbr.translate(lines) == [found[0].text if found else "" for found in mbr.candidates(lines)]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mbr": "ter"}, r"^decoding\.mbr=ter must be chrf or bleu"),
        ({"mbr": "chrf", "sample": True, "beam_size": 1}, r"^decoding\.sample=true with decoding\.mbr: MBR draws"),
        ({"mbr": "chrf", "mbr_nbest": 5}, r"^decoding\.mbr_nbest=5 must be a whole number from 0 to the beam size"),
        ({"mbr": "chrf", "mbr_nbest": 0}, r"^decoding\.mbr_samples=0 must be >= 1 with decoding\.mbr_nbest=0"),
    ],
)
def test_bad_mbr_settings_name_their_key(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message), tool_keys():
        DecodingOptions(**options)
