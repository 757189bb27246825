"""Corpus scores of detokenized translations: sacreBLEU, chrF, and the paper's tokenized BLEU.

The number to compare across papers is sacreBLEU on detokenized text with its signature (Post, 2018).
The paper's own En→De numbers were computed differently: Moses-tokenized text (after replacing Unicode
punctuation) with hyphenated compounds split (``rot-weiß`` → ``rot ##AT##-##AT## weiß``), scored by
``multi-bleu.perl`` (tensor2tensor's ``get_ende_bleu.sh``). That "tokenized BLEU" is reported separately
and always labelled as such.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache
from typing import Any

import sacrebleu
from sacremoses import MosesPunctNormalizer, MosesTokenizer

# sacreBLEU's defaults, spelled out: 13a tokenization, cased, exponential smoothing.
BLEU_SETTINGS = {"tokenize": "13a", "lowercase": False}

_COMPOUND = re.compile(r"(\S)-(\S)")


@cache
def _moses(lang: str) -> tuple[MosesPunctNormalizer, MosesTokenizer]:
    return MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)


def split_compounds(line: str) -> str:
    """tensor2tensor's ``s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g``: hyphens inside words become tokens."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def paper_tokenized(lines: Sequence[str], lang: str) -> list[str]:
    """``replace-unicode-punctuation.perl``, Moses ``tokenizer.perl -l <lang>`` (with its default escaping),
    then compound splitting: the steps of tensor2tensor's ``get_ende_bleu.sh``."""
    punctuation, tokenizer = _moses(lang)
    return [
        split_compounds(tokenizer.tokenize(punctuation.replace_unicode_punct(line), return_str=True)) for line in lines
    ]


def corpus_scores(
    hypotheses: Sequence[str], references: Sequence[str], tokenized_bleu_lang: str | None = None
) -> dict[str, Any]:
    """sacreBLEU and chrF (with signatures); with a language, also the paper-style tokenized BLEU."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu = sacrebleu.BLEU(**BLEU_SETTINGS)
    chrf = sacrebleu.CHRF()
    scores: dict[str, Any] = {
        "sacrebleu": bleu.corpus_score(hypotheses, [references]).score,
        "sacrebleu_signature": str(bleu.get_signature()),
        "chrf": chrf.corpus_score(hypotheses, [references]).score,
        "chrf_signature": str(chrf.get_signature()),
    }
    if tokenized_bleu_lang is not None:
        # multi-bleu.perl: the text is already tokenized, cased, no smoothing.
        tokenized = sacrebleu.BLEU(tokenize="none", smooth_method="none", force=True)
        score = tokenized.corpus_score(
            paper_tokenized(hypotheses, tokenized_bleu_lang), [paper_tokenized(references, tokenized_bleu_lang)]
        )
        scores["tokenized_bleu"] = score.score
        scores["tokenized_bleu_note"] = (
            f"paper-style: Moses-tokenized ({tokenized_bleu_lang}) with compounds split at hyphens, "
            "multi-bleu.perl; not comparable with sacreBLEU"
        )
    return scores
