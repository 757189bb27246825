"""Minimum Bayes risk decoding (Kumar and Byrne, 2004; for NMT, Eikema and Aziz, 2020; Freitag et al.,
2022): of a line's candidate translations, the one with the highest expected utility, the mean of its
utility against every candidate, the candidates standing in for draws from the model (a Monte Carlo
estimate: each weighs 1, so a translation found twice counts twice). The utility is sacreBLEU's sentence
chrF or BLEU of the hypothesis with the other candidate as its reference.

The candidates come from the translator's search (:class:`~aiayn.model.DecodingOptions`: the beam's
``mbr_nbest`` best and ``mbr_samples`` draws); each distinct text is scored once against each distinct
text, weighed by how often it was found."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import sacrebleu

if TYPE_CHECKING:
    from aiayn.evaluation.translator import Candidate


def sentence_scorer(utility: str) -> sacrebleu.metrics.base.Metric:
    """sacreBLEU's scorer of one hypothesis against one reference: chrF, or BLEU with the effective
    order (short sentences lack 4-grams; without it most pairs would score 0)."""
    return sacrebleu.CHRF() if utility == "chrf" else sacrebleu.BLEU(effective_order=True)


def expected_utilities(texts: Sequence[str], utility: str) -> dict[str, float]:
    """Each distinct text of ``texts`` with its expected utility: the mean over all of ``texts`` (each
    as a reference) of its sentence score."""
    scorer, counts = sentence_scorer(utility), Counter(texts)

    def expected(hypothesis: str) -> float:
        scores = (count * scorer.sentence_score(hypothesis, [reference]).score for reference, count in counts.items())
        return sum(scores) / len(texts)

    return {hypothesis: expected(hypothesis) for hypothesis in counts}


def mbr_ranked(candidates: Sequence[Candidate], utility: str) -> list[Candidate]:
    """The distinct candidates by expected utility, highest first (of equal ones, the first found), each
    with its expected utility as its ``score`` (0 to 100) and the log-probability it was found with."""
    if not candidates:
        return []
    expected = expected_utilities([candidate.text for candidate in candidates], utility)
    first = {}
    for candidate in candidates:
        first.setdefault(candidate.text, candidate)
    ranked = sorted(first.values(), key=lambda candidate: -expected[candidate.text])
    return [replace(candidate, score=expected[candidate.text]) for candidate in ranked]
