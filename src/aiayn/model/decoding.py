"""Decoding entry points: greedy and beam search, both through the decoder's key/value caches."""

from __future__ import annotations

import torch

from aiayn.model.beam_search import beam_search
from aiayn.model.transformer import Transformer


def greedy_decode(
    model: Transformer, src: torch.Tensor, bos_id: int, eos_id: int, max_len_offset: int = 50
) -> list[list[int]]:
    """The arg-max token at every step, up to source length + ``max_len_offset`` (beam search with one beam)."""
    return translate_ids(model, src, bos_id, eos_id, beam_size=1, max_len_offset=max_len_offset)


def translate_ids(
    model: Transformer,
    src: torch.Tensor,
    bos_id: int,
    eos_id: int,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len_offset: int = 50,
) -> list[list[int]]:
    """Source ids (B, S) → the best hypothesis of each sentence, without BOS and EOS."""
    hypotheses = beam_search(model, src, bos_id, eos_id, beam_size, alpha, max_len_offset)
    return [hypothesis.tokens for hypothesis in hypotheses]
