"""Slow, obviously correct decoders that the fast ones are checked against."""

from __future__ import annotations

import itertools

import torch

from aiayn.model import Transformer, length_penalty

BOS, EOS = 2, 3
NEVER = [0, BOS]  # PAD and BOS are never generated


@torch.no_grad()
def recomputing_greedy(model: Transformer, src: torch.Tensor, max_len_offset: int) -> list[list[int]]:
    """Re-run the decoder over the whole prefix at every step, one sentence at a time, take the arg-max."""
    hypotheses = []
    for row in src:
        row = row[row.ne(0)][None]
        memory, padding = model.encode(row)
        tokens = [BOS]
        for _ in range(row.size(1) + max_len_offset):
            logits = model.decode(torch.tensor([tokens]), memory, padding)[0, -1]
            logits[NEVER] = float("-inf")
            nxt = int(logits.argmax())
            if nxt == EOS:
                break
            tokens.append(nxt)
        hypotheses.append(tokens[1:])
    return hypotheses


@torch.no_grad()
def sequence_log_prob(model: Transformer, src_row: torch.Tensor, tokens: list[int]) -> float:
    """log P(tokens + EOS | source) by teacher forcing."""
    src_row = src_row[src_row.ne(0)][None]
    tgt_in = torch.tensor([[BOS, *tokens]])
    log_probs = model(src_row, tgt_in)[0].float().log_softmax(dim=-1)
    target = torch.tensor([*tokens, EOS])
    return float(log_probs.gather(1, target[:, None]).sum())


def exhaustive_best(
    model: Transformer, src_row: torch.Tensor, max_len_offset: int, alpha: float
) -> tuple[list[int], float]:
    """Score every sequence of allowed tokens up to the length limit; return the best and its score."""
    vocab = model.cfg.vocab_size
    allowed = [t for t in range(vocab) if t not in (*NEVER, EOS)]
    limit = int(src_row.ne(0).sum()) + max_len_offset
    best: tuple[list[int], float] = ([], float("-inf"))
    for length in range(limit + 1):
        for tokens in itertools.product(allowed, repeat=length):
            score = sequence_log_prob(model, src_row, list(tokens)) / length_penalty(length + 1.0, alpha)
            if score > best[1]:
                best = (list(tokens), score)
    return best
