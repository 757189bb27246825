"""How a translation is searched for, and the rules every search applies at each step.

The paper decodes with beam search, beam size 4, length penalty α = 0.6 and outputs of at most source
length + 50 tokens (§6.1). Research goes further, as fairseq, OpenNMT, Marian and CTranslate2 do:
sampling (for back-translation), the ``power`` length penalty ``|Y|^α`` of fairseq, Hugging Face and
CTranslate2, a minimum length and no repeated n-grams. :class:`DecodingOptions` holds them all;
:func:`step_rules` applies the rules to the log-probabilities of a step, for beam search
(:mod:`aiayn.model.beam_search`) and sampling (:mod:`aiayn.model.sampling`) alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from aiayn.errors import FieldError, is_number, whole

LENGTH_PENALTIES = ("gnmt", "power")
ENSEMBLE_MEANS = ("log_prob", "prob")  # how an ensemble's members combine at each step
MBR_UTILITIES = ("chrf", "bleu")  # minimum Bayes risk decoding's utilities (sacreBLEU's sentence scores)


@dataclass(frozen=True)
class DecodingOptions:
    """``beam_size`` hypotheses (1: greedy), or ``sample`` (one token drawn per step, from the
    distribution sharpened or flattened by ``temperature`` and cut to the ``top_k`` tokens and the
    ``top_p`` nucleus); the length penalty ``length_penalty`` with exponent ``alpha``; outputs of
    ``min_len`` to source length + ``max_len_offset`` tokens; no n-gram of ``no_repeat_ngram`` tokens
    twice; an ensemble's members combined by the mean of their log-probabilities (``ensemble``:
    ``log_prob``) or of their probabilities (``prob``, fairseq's). With ``mbr`` (a utility: ``chrf`` or
    ``bleu``), minimum Bayes risk decoding: the translation is the candidate with the highest mean utility
    against all candidates, the beam's ``mbr_nbest`` best and ``mbr_samples`` draws
    (:mod:`aiayn.evaluation.mbr`; the search here makes the candidates). The paper's by default (§6.1).

    Checked once, where it is made; validation, test, the dashboard's samples, ``aiayn-eval`` and
    ``aiayn-translate`` pass it whole.
    """

    beam_size: int = 4
    alpha: float = 0.6
    max_len_offset: int = 50
    length_penalty: str = "gnmt"
    min_len: int = 0
    no_repeat_ngram: int = 0
    sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    ensemble: str = "log_prob"
    mbr: str | None = None
    mbr_nbest: int | None = None  # None: the whole beam
    mbr_samples: int = 0

    def __post_init__(self) -> None:
        if not whole(self.beam_size, 1):
            raise FieldError("beam_size", self.beam_size, "must be a whole number >= 1 (1 is greedy decoding)")
        if not is_number(self.alpha) or self.alpha < 0:
            raise FieldError("alpha", self.alpha, "must be a number >= 0 (0: no length penalty; the paper uses 0.6)")
        if not whole(self.max_len_offset, 0):
            raise FieldError("max_len_offset", self.max_len_offset, "must be a whole number >= 0 (the paper uses 50)")
        if self.length_penalty not in LENGTH_PENALTIES:
            raise FieldError("length_penalty", self.length_penalty, "must be gnmt ((5 + |Y|) / 6)^α or power |Y|^α")
        if not whole(self.min_len, 0):
            raise FieldError("min_len", self.min_len, "must be a whole number of tokens >= 0")
        if not whole(self.no_repeat_ngram, 0):
            raise FieldError("no_repeat_ngram", self.no_repeat_ngram, "must be a whole number >= 0 (0: no rule)")
        if not isinstance(self.sample, bool):
            raise FieldError("sample", self.sample, "must be true or false")
        if self.sample and self.beam_size != 1:
            raise FieldError("beam_size", self.beam_size, "must be 1 when sampling (nbest=N draws N samples)")
        if not is_number(self.temperature) or not self.temperature > 0:
            raise FieldError("temperature", self.temperature, "must be a number > 0 (1: the model's distribution)")
        if not whole(self.top_k, 0):
            raise FieldError("top_k", self.top_k, "must be a whole number >= 0 (0: every token)")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise FieldError("top_p", self.top_p, "must be a number in (0, 1] (1: every token)")
        if self.ensemble not in ENSEMBLE_MEANS:
            allowed = "must be log_prob (the mean of the members' log-probabilities) or prob (of their probabilities)"
            raise FieldError("ensemble", self.ensemble, allowed)
        if self.mbr is not None:
            self._check_mbr()

    def _check_mbr(self) -> None:
        """Minimum Bayes risk decoding's settings: a utility, and candidates from the beam and/or draws."""
        if self.mbr not in MBR_UTILITIES:
            raise FieldError("mbr", self.mbr, "must be chrf or bleu (the utility), or null: no MBR")
        if self.sample:
            raise FieldError("sample", True, "with {mbr}: MBR draws its own candidates, {mbr_samples}=N of them")
        if self.mbr_nbest is not None and (not whole(self.mbr_nbest, 0) or self.mbr_nbest > self.beam_size):
            allowed = f"must be a whole number from 0 to the beam size ({self.beam_size}): the beam's candidates"
            raise FieldError("mbr_nbest", self.mbr_nbest, allowed)
        if not whole(self.mbr_samples, 0):
            raise FieldError("mbr_samples", self.mbr_samples, "must be a whole number of sampled candidates >= 0")
        if self.mbr_beam + self.mbr_samples < 1:
            raise FieldError("mbr_samples", self.mbr_samples, "must be >= 1 with {mbr_nbest}=0: MBR needs candidates")

    def check_nbest(self, nbest: int) -> None:
        """``nbest`` translations of each line: the best of the beam (at most its size), or draws, or the
        MBR candidates with the highest expected utility (at most as many as there are)."""
        if self.mbr is not None and whole(nbest, 1) and nbest <= self.mbr_beam + self.mbr_samples:
            return
        if not whole(nbest, 1) or (not self.sample and nbest > self.beam_size):
            allowed = f"must be a whole number from 1 to the beam size ({self.beam_size}), or any number of samples"
            raise FieldError("nbest", nbest, f"{allowed} with decoding=sample")

    @property
    def mbr_beam(self) -> int:
        """How many of the beam's best are MBR candidates: ``mbr_nbest``, or the whole beam."""
        return self.beam_size if self.mbr_nbest is None else self.mbr_nbest

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PAPER_DECODING = DecodingOptions()  # §6.1: beam 4, α = 0.6, at most source length + 50 tokens


def length_penalty(length: torch.Tensor | float, alpha: float, kind: str = "gnmt") -> torch.Tensor | float:
    """The divisor of a finished hypothesis' log-probability; ``length`` counts its tokens with EOS (as
    fairseq does). ``gnmt``: ``((5 + |Y|) / 6) ** α`` (Wu et al., 2016, eq. 14; the paper's α = 0.6);
    ``power``: ``|Y| ** α`` (fairseq's ``--lenpen``, Hugging Face, CTranslate2). α = 0 gives 1."""
    return (length if kind == "power" else (5.0 + length) / 6.0) ** alpha


def step_rules(
    log_probs: torch.Tensor,
    tokens: torch.Tensor,
    step: int,
    at_limit: torch.Tensor,
    never: torch.Tensor,
    eos_id: int,
    options: DecodingOptions,
) -> torch.Tensor:
    """``log_probs`` (rows, vocab) of the token after ``tokens`` (rows, step + 1: BOS and the ``step``
    tokens so far) with what may not come next at -inf, in place: PAD and BOS (``never``); a token that
    would repeat an n-gram (``no_repeat_ngram``); EOS before ``min_len`` tokens; anything but EOS where
    ``at_limit`` (rows,) says the output has its longest length (that rule wins: every output ends)."""
    log_probs.index_fill_(1, never, float("-inf"))
    eos = log_probs[:, eos_id].clone()
    n = options.no_repeat_ngram
    if n and step >= n:
        log_probs.masked_fill_(repeated_ngram_ends(tokens[:, 1:], n, log_probs.size(1)), float("-inf"))
    if step < options.min_len:
        log_probs[:, eos_id] = float("-inf")
    if bool(at_limit.any()):
        log_probs[at_limit] = float("-inf")
        log_probs[at_limit, eos_id] = eos[at_limit]
    return log_probs


def repeated_ngram_ends(generated: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    """(rows, vocab) True for each token that, after ``generated`` (rows, length), would complete an
    n-gram the row already holds: the tokens that followed an earlier occurrence of its last n - 1."""
    rows, length = generated.shape
    banned = torch.zeros(rows, vocab, dtype=torch.long, device=generated.device)
    if length < n:  # no n-gram is complete yet
        return banned.bool()
    windows = generated.unfold(1, n, 1)  # (rows, length - n + 1, n): every n-gram so far
    prefix = generated[:, length - (n - 1) :]  # the last n - 1 tokens
    match = windows[:, :, : n - 1].eq(prefix[:, None, :]).all(dim=-1)  # (rows, windows)
    banned.scatter_reduce_(1, windows[:, :, -1], match.long(), reduce="amax")
    return banned.bool()
