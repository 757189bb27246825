"""Corpus scores of detokenized translations: sacreBLEU, chrF, the paper's tokenized BLEU, and the
paired bootstrap test that says whether one system's BLEU differs from another's by more than chance.

The number to compare across papers is sacreBLEU on detokenized text with its signature (Post, 2018).
The paper's own En→De and En→Fr numbers were computed differently: Moses-tokenized text with hyphenated
compounds split (``rot-weiß`` → ``rot ##AT##-##AT## weiß``), scored by ``multi-bleu.perl`` (tensor2tensor's
``get_ende_bleu.sh``, :data:`TOKENIZED_BLEU_SCRIPT`). That "tokenized BLEU" is reported separately and
always labelled as such.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np
import sacrebleu
from sacrebleu.metrics.bleu import BLEU
from sacrebleu.significance import PairedTest, _compute_p_value, estimate_ci

if TYPE_CHECKING:
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

# sacreBLEU's defaults, spelled out: 13a tokenization, cased, exponential smoothing.
BLEU_SETTINGS = {"tokenize": "13a", "lowercase": False}
BOOTSTRAP_SAMPLES = 1000  # sacreBLEU's default for --paired-bs
SIGNIFICANCE_LEVEL = 0.05  # a p-value below it: significant; at or above it: not significant
# Which script the tokenized BLEU follows: its steps changed once, and references and hypotheses differ.
TOKENIZED_BLEU_SCRIPT = (
    "tensor2tensor's get_ende_bleu.sh as of its 2018 change (fc9335c) that added "
    "replace-unicode-punctuation for the hypotheses"
)

_COMPOUND = re.compile(r"(\S)-(\S)")


@cache
def _moses(lang: str) -> tuple[MosesPunctNormalizer, MosesTokenizer]:
    from sacremoses import MosesPunctNormalizer, MosesTokenizer  # only tokenized BLEU needs it (~1 s to import)

    return MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)


def split_compounds(line: str) -> str:
    """tensor2tensor's ``s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g``: hyphens inside words become tokens."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def paper_tokenized(lines: Sequence[str], lang: str, *, hypotheses: bool) -> list[str]:
    """The steps of tensor2tensor's ``get_ende_bleu.sh`` as of its 2018 change that added
    ``replace-unicode-punctuation.perl`` for the hypotheses: hypotheses are punctuation-normalised, then
    Moses-tokenized (``tokenizer.perl -l <lang>``, its default escaping) and compound-split; references
    (the script's pre-tokenized ``newstest2013.tok.de``) are only Moses-tokenized and compound-split, so a
    reference's ``“…”`` stays as it is while a hypothesis's becomes ``&quot;...&quot;``."""
    punctuation, tokenizer = _moses(lang)
    if hypotheses:
        lines = [punctuation.replace_unicode_punct(line) for line in lines]
    return [split_compounds(tokenizer.tokenize(line, return_str=True)) for line in lines]


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
            paper_tokenized(hypotheses, tokenized_bleu_lang, hypotheses=True),
            [paper_tokenized(references, tokenized_bleu_lang, hypotheses=False)],
        )
        scores["tokenized_bleu"] = score.score
        scores["tokenized_bleu_note"] = (
            f"paper-style: Moses-tokenized ({tokenized_bleu_lang}) with compounds split at hyphens, "
            f"multi-bleu.perl, following {TOKENIZED_BLEU_SCRIPT}; not comparable with sacreBLEU"
        )
    return scores


@dataclass(frozen=True)
class SystemScore:
    """One system of a paired bootstrap test. ``mean ± ci`` is sacreBLEU's estimate over the resamples
    (``ci``: half the width of their 95% interval); the baseline has no difference and no p-value."""

    name: str
    score: float  # the system's corpus score: BLEU, or the mean of its segments' COMET
    mean: float
    ci: float
    difference: float | None = None  # score minus the baseline's score
    difference_ci: tuple[float, float] | None = None  # 95% interval of the resampled differences
    p_value: float | None = None


@dataclass(frozen=True)
class PairedBootstrap:
    """The result of :func:`paired_bootstrap`: the baseline first, then the systems in the order given."""

    systems: list[SystemScore]
    samples: int
    seed: int | None  # None: drawn from the OS's entropy, not repeatable
    signature: str  # the metric's signature (sacreBLEU's for BLEU) with the test's ``bs`` and ``seed``


def bootstrap_seed() -> int | None:
    """The seed sacreBLEU's paired test draws its resamples with: ``$SACREBLEU_SEED``, else 12345; None
    for ``none`` and, as :class:`~sacrebleu.significance.PairedTest` treats it, for 0."""
    seed = os.environ.get("SACREBLEU_SEED", "12345")
    return None if seed.lower() == "none" else int(seed) or None


def paired_bootstrap(
    systems: Sequence[tuple[str, Sequence[str]]], references: Sequence[str], samples: int = BOOTSTRAP_SAMPLES
) -> PairedBootstrap:
    """sacreBLEU's paired bootstrap resampling of BLEU (:data:`BLEU_SETTINGS`): the first of ``systems``
    (name, hypotheses) is the baseline, as the first ``-i`` system of ``sacrebleu REF -i BASE SYS
    --paired-bs``, and gets the same numbers: each system's BLEU, ``mean ± ci`` over ``samples``
    resamples, and the p-value of its difference to the baseline (Koehn, 2004). A p-value of 0.05 or
    more means the difference is not significant: chance alone produces it often enough.

    sacreBLEU does not return the resampled scores, so the 95% interval of the difference is computed
    here, from the very resamples sacreBLEU draws (the same generator, seed and draw; None when the seed
    is not fixed, since those resamples cannot be drawn again)."""
    if len(systems) < 2 or not references:
        raise ValueError("a paired test needs a baseline, at least one system and references")
    for name, hypotheses in systems:
        if len(hypotheses) != len(references):
            raise ValueError(f"{name}: {len(hypotheses)} hypotheses but {len(references)} references")
    test = PairedTest(
        [(name, list(hypotheses)) for name, hypotheses in systems],
        {"BLEU": BLEU(**BLEU_SETTINGS)},
        [list(references)],
        test_type="bs",
        n_samples=samples,
    )
    signatures, scores = test()
    (metric,) = (name for name in scores if name != "System")
    seed = bootstrap_seed()
    (baseline_name, baseline), *others = systems
    first, *rest = scores[metric]
    results = [SystemScore(baseline_name, first.score, float(first.mean), float(first.ci))]
    for (name, hypotheses), result in zip(others, rest, strict=True):
        interval = None if seed is None else difference_interval(baseline, hypotheses, references, test.n_samples, seed)
        difference = result.score - first.score
        results.append(
            SystemScore(name, result.score, float(result.mean), float(result.ci), difference, interval, result.p_value)
        )
    return PairedBootstrap(results, test.n_samples, seed, str(signatures[metric]))


def difference_interval(
    baseline: Sequence[str], system: Sequence[str], references: Sequence[str], samples: int, seed: int
) -> tuple[float, float]:
    """The 95% interval of ``system``'s BLEU minus ``baseline``'s over the resamples sacreBLEU's paired
    test draws with ``seed`` (``_paired_bs_test``: one ``default_rng(seed).choice`` of all resamples'
    indices, float32 sentence statistics), bounded as sacreBLEU's ``estimate_ci`` bounds its intervals:
    the resamples 1/40 in from either end."""
    metric = BLEU(**BLEU_SETTINGS)
    n = len(references)
    indices = np.random.default_rng(seed).choice(n, size=(samples, n), replace=True)
    refs = [list(references)]
    base, other = (
        np.array(metric._extract_corpus_statistics(hyps, refs), dtype="float32") for hyps in (baseline, system)
    )
    differences = np.sort(
        [
            metric._compute_score_from_stats(other[row].sum(0)).score
            - metric._compute_score_from_stats(base[row].sum(0)).score
            for row in indices
        ]
    )
    lower = samples // 40
    return float(differences[lower]), float(differences[samples - lower - 1])


def paired_bootstrap_segments(
    systems: Sequence[tuple[str, Sequence[float]]], metric: str, samples: int = BOOTSTRAP_SAMPLES
) -> PairedBootstrap:
    """The test of :func:`paired_bootstrap` for a metric whose corpus score is the mean of its segments'
    (COMET): the same resamples (sacreBLEU's ``default_rng(seed).choice`` of every resample's segments),
    the same statistic (the absolute resampled difference, centred, against the real one) and sacreBLEU's
    own ``estimate_ci`` and ``_compute_p_value``. ``metric`` names the scores in the signature."""
    if len(systems) < 2 or not len(systems[0][1]):
        raise ValueError("a paired test needs a baseline, at least one system and segments")
    (baseline_name, baseline), *others = [(name, np.asarray(scores, dtype="float64")) for name, scores in systems]
    for name, scores in others:
        if len(scores) != len(baseline):
            raise ValueError(f"{name}: {len(scores)} segment scores but {len(baseline)} for {baseline_name}")
    seed = bootstrap_seed()
    indices = np.random.default_rng(seed).choice(len(baseline), size=(samples, len(baseline)), replace=True)
    resampled_baseline = baseline[indices].mean(1)
    mean, ci = estimate_ci(resampled_baseline)
    results = [SystemScore(baseline_name, float(baseline.mean()), float(mean), float(ci))]
    for name, scores in others:
        resampled = scores[indices].mean(1)
        differences = np.abs(resampled - resampled_baseline)
        p_value = _compute_p_value(differences - differences.mean(), abs(scores.mean() - baseline.mean()))
        mean, ci = estimate_ci(resampled)
        ordered = np.sort(resampled - resampled_baseline)
        lower = samples // 40  # sacreBLEU's estimate_ci bounds: 1/40 in from either end
        interval = None if seed is None else (float(ordered[lower]), float(ordered[samples - lower - 1]))
        difference = float(scores.mean() - baseline.mean())
        results.append(SystemScore(name, float(scores.mean()), float(mean), float(ci), difference, interval, p_value))
    return PairedBootstrap(results, samples, seed, f"{metric}|bs:{samples}|seed:{str(seed).lower()}")
