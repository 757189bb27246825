"""Decoding entry points: the best translation of each sentence (beam search through the key/value caches)."""

from __future__ import annotations

import torch

from aiayn.model.beam_search import PAPER_DECODING, DecodingOptions, beam_search
from aiayn.model.transformer import Transformer


def translate_ids(
    model: Transformer, src: torch.Tensor, bos_id: int, eos_id: int, options: DecodingOptions = PAPER_DECODING
) -> list[list[int]]:
    """Source ids (B, S) → the best hypothesis of each sentence, without BOS and EOS."""
    return [hypothesis.tokens for hypothesis in beam_search(model, src, bos_id, eos_id, options)]


def greedy_decode(
    model: Transformer, src: torch.Tensor, bos_id: int, eos_id: int, max_len_offset: int = 50
) -> list[list[int]]:
    """The arg-max token at every step, up to source length + ``max_len_offset`` (beam search with one beam)."""
    return translate_ids(model, src, bos_id, eos_id, DecodingOptions(beam_size=1, max_len_offset=max_len_offset))
