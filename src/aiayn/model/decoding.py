"""Greedy decoding: the arg-max token at each step, up to source length + an offset (§6.1)."""

from __future__ import annotations

import torch

from aiayn.model.transformer import Transformer


@torch.no_grad()
def greedy_decode(
    model: Transformer, src: torch.Tensor, bos_id: int, eos_id: int, max_len_offset: int = 50
) -> list[list[int]]:
    """Translate a batch of source ids (B, S); returns each hypothesis without BOS and EOS.

    Every sentence may produce up to (its source length + ``max_len_offset``) tokens; decoding stops
    as soon as every sentence has emitted EOS. Each step feeds one token through the decoder's
    key/value caches instead of recomputing the prefix.
    """
    pad_id = model.cfg.pad_id
    memory, src_padding = model.encode(src)
    src_lengths = src.ne(pad_id).sum(dim=1)  # (B,)
    max_lengths = src_lengths + max_len_offset
    batch = src.size(0)
    tokens = torch.full((batch, 1), bos_id, dtype=torch.long, device=src.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
    state = model.init_state()
    for step in range(int(max_lengths.max()) + 1):
        logits = model.decode(tokens[:, -1:], memory, src_padding, state)[:, -1]  # (B, vocab)
        next_token = logits.argmax(dim=-1)
        # A sentence at its length limit is closed with EOS; a finished one only pads.
        next_token = torch.where(max_lengths.le(step), torch.full_like(next_token, eos_id), next_token)
        next_token = next_token.masked_fill(finished, pad_id)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        finished |= next_token.eq(eos_id)
        if bool(finished.all()):
            break
    hypotheses = []
    for row in tokens[:, 1:].tolist():
        hypothesis = []
        for token in row:
            if token in (eos_id, pad_id):
                break
            hypothesis.append(token)
        hypotheses.append(hypothesis)
    return hypotheses
