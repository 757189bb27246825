"""Decoding entry points (greedy and beam search, both through the key/value caches) and their options."""

from __future__ import annotations

import math

import torch

from aiayn.errors import ConfigError
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


def check_decoding(beam_size: int, alpha: float, max_len_offset: int) -> None:
    """Fail before any work on decoding options that beam search cannot use."""
    if not isinstance(beam_size, int) or beam_size < 1:
        raise ConfigError("decoding.beam_size", beam_size, "must be a whole number >= 1 (1 is greedy decoding)")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha < 0:
        raise ConfigError("decoding.alpha", alpha, "must be a number >= 0 (0: no length penalty; the paper uses 0.6)")
    if not isinstance(max_len_offset, int) or max_len_offset < 0:
        raise ConfigError("decoding.max_len_offset", max_len_offset, "must be a whole number >= 0 (the paper uses 50)")
