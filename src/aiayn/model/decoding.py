"""Decoding entry points: the translations of a batch, by beam search (:mod:`.beam_search`) or by
sampling (:mod:`.sampling`) as the options say, with one model or an ensemble."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aiayn.model.beam_search import Hypothesis, nbest_search
from aiayn.model.decoding_options import PAPER_DECODING, DecodingOptions
from aiayn.model.sampling import sample
from aiayn.model.transformer import Transformer


def search(
    model: Transformer | Sequence[Transformer],
    src: torch.Tensor,
    bos_id: int,
    eos_id: int,
    options: DecodingOptions = PAPER_DECODING,
    nbest: int = 1,
    seed: int = 0,
    sentences: torch.Tensor | None = None,
) -> list[list[Hypothesis]]:
    """Source ids (B, S) → for each sentence its ``nbest`` best hypotheses (beam search, best first) or
    ``nbest`` samples (``options.sample``, in the order drawn, decided by ``seed`` and the sentences'
    numbers ``sentences``, by default their rows)."""
    if options.sample:
        numbers = sentences if sentences is not None else torch.arange(src.size(0))
        return sample(model, src, bos_id, eos_id, options, seed, numbers, nbest)
    return nbest_search(model, src, bos_id, eos_id, options, nbest)


def translate_ids(
    model: Transformer | Sequence[Transformer],
    src: torch.Tensor,
    bos_id: int,
    eos_id: int,
    options: DecodingOptions = PAPER_DECODING,
) -> list[list[int]]:
    """Source ids (B, S) → the best hypothesis (or the first sample) of each sentence, without BOS and EOS."""
    return [found[0].tokens for found in search(model, src, bos_id, eos_id, options)]


def greedy_decode(
    model: Transformer, src: torch.Tensor, bos_id: int, eos_id: int, max_len_offset: int = 50
) -> list[list[int]]:
    """The arg-max token at every step, up to source length + ``max_len_offset`` (beam search with one beam)."""
    return translate_ids(model, src, bos_id, eos_id, DecodingOptions(beam_size=1, max_len_offset=max_len_offset))
