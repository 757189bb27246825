"""Slow, obviously correct decoders that the fast ones are checked against."""

from __future__ import annotations

import itertools

import torch

from aiayn.model import Transformer, TransformerConfig, length_penalty

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
def step_log_probs(model: Transformer, src_row: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """log P of each of tokens + EOS given the source and the tokens before it, by teacher forcing."""
    src_row = src_row[src_row.ne(0)][None]
    tgt_in = torch.tensor([[BOS, *tokens]])
    log_probs = model(src_row, tgt_in)[0].float().log_softmax(dim=-1)
    target = torch.tensor([*tokens, EOS])
    return log_probs.gather(1, target[:, None])[:, 0]


def sequence_log_prob(model: Transformer, src_row: torch.Tensor, tokens: list[int]) -> float:
    """log P(tokens + EOS | source) by teacher forcing."""
    return float(step_log_probs(model, src_row, tokens).sum())


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


def ensemble_log_prob(
    models: list[Transformer], src_row: torch.Tensor, tokens: list[int], mean: str = "log_prob"
) -> float:
    """An ensemble's log P(tokens + EOS | source): at each step the mean of the models' log-probabilities,
    so over the sequence the mean of their sequence log-probabilities; with ``mean="prob"``, at each step
    the log of the mean of their probabilities, summed over the steps."""
    if mean == "log_prob":
        return sum(sequence_log_prob(model, src_row, tokens) for model in models) / len(models)
    steps = torch.stack([step_log_probs(model, src_row, tokens).double().exp() for model in models])
    return float(steps.mean(dim=0).log().sum())


def exhaustive_ranking(
    models: list[Transformer],
    src_row: torch.Tensor,
    max_len_offset: int,
    alpha: float,
    kind: str = "gnmt",
    mean: str = "log_prob",
) -> list[tuple[list[int], float]]:
    """Every sequence of allowed tokens up to the length limit with its score, best first."""
    vocab = models[0].cfg.vocab_size
    allowed = [t for t in range(vocab) if t not in (*NEVER, EOS)]
    limit = int(src_row.ne(0).sum()) + max_len_offset
    scored = [
        (
            list(tokens),
            ensemble_log_prob(models, src_row, list(tokens), mean) / length_penalty(length + 1.0, alpha, kind),
        )
        for length in range(limit + 1)
        for tokens in itertools.product(allowed, repeat=length)
    ]
    return sorted(scored, key=lambda item: -item[1])


class EosBiasedTransformer(Transformer):
    """Adds ``eos_bonus`` to EOS's logit (to end sentences at varied lengths) and counts decoder calls."""

    eos_bonus = 0.0
    calls = 0

    def decode(self, *args, **kwargs) -> torch.Tensor:  # type: ignore[override]
        self.calls += 1
        logits = super().decode(*args, **kwargs)
        logits[..., EOS] += self.eos_bonus
        return logits


def biased_model(vocab: int, eos_bonus: float, sharpen: float = 1.0, seed: int = 1) -> EosBiasedTransformer:
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=vocab, n_layers=2, d_model=32, d_ff=64, n_heads=2, d_k=8, d_v=12)
    model = EosBiasedTransformer(cfg).eval()
    model.eos_bonus = eos_bonus
    with torch.no_grad():
        model.output_proj.weight.mul_(sharpen)
    return model
