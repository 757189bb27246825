"""sacreBLEU, chrF and the paper's tokenized BLEU with compound splitting."""

from __future__ import annotations

import pytest
import sacrebleu

from aiayn.scoring import TOKENIZED_BLEU_SCRIPT, corpus_scores, paper_tokenized, split_compounds

HYPS = ["Ein Mann in einem rot-weißen T-Shirt fährt Fahrrad.", "Zwei Hunde spielen im Schnee."]
REFS = ["Ein Mann in einem rot-weißen Hemd fährt ein Fahrrad.", "Zwei Hunde spielen im Schnee."]


def test_compounds_are_split_at_hyphens_as_tensor2tensor_does() -> None:
    assert split_compounds("rot-weißen T-Shirt") == "rot ##AT##-##AT## weißen T ##AT##-##AT## Shirt"
    assert split_compounds("a-b-c - d") == "a ##AT##-##AT## b-c - d"  # perl's s///g: matches do not overlap
    for hypotheses in (True, False):
        assert paper_tokenized(['Er sagt: "Hallo!"'], "de", hypotheses=hypotheses) == [
            "Er sagt : &quot; Hallo ! &quot;"
        ]


def test_only_hypotheses_have_their_unicode_punctuation_replaced() -> None:
    """get_ende_bleu.sh since tensor2tensor's 2018 change runs replace-unicode-punctuation.perl on the
    decodes only; the references (newstest2013.tok.de) are only tokenized and compound-split."""
    line = "Er sagt: “Hallo” … und geht."
    (reference,) = paper_tokenized([line], "de", hypotheses=False)
    (hypothesis,) = paper_tokenized([line], "de", hypotheses=True)
    assert reference == "Er sagt : “ Hallo ” … und geht ."
    assert hypothesis == "Er sagt : &quot; Hallo &quot; ... und geht ."
    # the same line as hypothesis and reference is no longer a perfect match
    assert corpus_scores([line], [line], tokenized_bleu_lang="de")["tokenized_bleu"] < 100
    scores = corpus_scores([line, *HYPS], [line, *REFS], tokenized_bleu_lang="de")
    tokenized = sacrebleu.corpus_bleu(
        [hypothesis, *paper_tokenized(HYPS, "de", hypotheses=True)],
        [[reference, *paper_tokenized(REFS, "de", hypotheses=False)]],
        tokenize="none",
        smooth_method="none",
    )
    assert scores["tokenized_bleu"] == pytest.approx(tokenized.score)
    assert "2018" in TOKENIZED_BLEU_SCRIPT and TOKENIZED_BLEU_SCRIPT in scores["tokenized_bleu_note"]


def test_scores_name_what_they_measure() -> None:
    scores = corpus_scores(HYPS, REFS, tokenized_bleu_lang="de")
    assert scores["sacrebleu"] == pytest.approx(sacrebleu.corpus_bleu(HYPS, [REFS]).score)
    assert scores["chrf"] == pytest.approx(sacrebleu.corpus_chrf(HYPS, [REFS]).score)
    assert "tok:13a" in scores["sacrebleu_signature"]
    # multi-bleu.perl on the tokenized text: no further tokenization, no smoothing
    tokenized = sacrebleu.corpus_bleu(
        paper_tokenized(HYPS, "de", hypotheses=True),
        [paper_tokenized(REFS, "de", hypotheses=False)],
        tokenize="none",
        smooth_method="none",
    )
    assert scores["tokenized_bleu"] == pytest.approx(tokenized.score)
    assert abs(scores["tokenized_bleu"] - scores["sacrebleu"]) > 0.1
    assert "not comparable" in scores["tokenized_bleu_note"]
    assert "tokenized_bleu" not in corpus_scores(HYPS, REFS)
    assert corpus_scores(REFS, REFS, "de")["tokenized_bleu"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        corpus_scores(HYPS, REFS[:1])
