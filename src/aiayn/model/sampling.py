"""Sampling: each next token drawn from the model's distribution (an ensemble's mean), sharpened or
flattened by a temperature and cut to the ``top_k`` most likely tokens and to the ``top_p`` nucleus
(Holtzman et al., 2020). Sampled translations are what back-translation (Edunov et al., 2018) and
sequence-level distillation train on.

A draw depends only on the seed of its sentence, the sample's number and the step: each uses a uniform
number from a counter-based hash of those three (SplitMix64), never a generator shared by the batch,
so the same seed gives the same samples whatever the batch size, the sentence's neighbours or the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aiayn.errors import FieldError, whole
from aiayn.model.beam_search import Hypothesis
from aiayn.model.decoding_options import DecodingOptions, length_penalty, step_rules
from aiayn.model.ensemble import Ensemble
from aiayn.model.transformer import Transformer

MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 torch stores (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN, MIX1, MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 tensors (wrapping arithmetic): equal inputs, equal outputs,
    on every device."""
    x = x + GOLDEN
    x = (x ^ _shift_right(x, 30)) * MIX1
    x = (x ^ _shift_right(x, 27)) * MIX2
    return x ^ _shift_right(x, 31)


def uniform(seed: int, sentence: torch.Tensor, sample: torch.Tensor, step: int) -> torch.Tensor:
    """A number in [0, 1) (float64) for each row, from the seed, its sentence's number, its sample's number
    and the step."""
    key = splitmix64(torch.tensor(_signed(seed & MASK64), device=sentence.device))
    key = splitmix64(splitmix64(splitmix64(key + sentence) + sample) + step)
    return _shift_right(key, 11).double() / float(1 << 53)


def filtered(log_probs: torch.Tensor, options: DecodingOptions) -> torch.Tensor:
    """The sampling distribution's log-weights (unnormalised): ``log_probs / temperature``, the tokens
    outside the ``top_k`` and outside the smallest set whose probability reaches ``top_p`` at -inf."""
    weights = log_probs / options.temperature
    if options.top_k and options.top_k < weights.size(-1):
        kth = weights.topk(options.top_k, dim=-1).values[:, -1:]
        weights = weights.masked_fill(weights < kth, float("-inf"))
    if options.top_p < 1.0:
        ordered, order = weights.sort(dim=-1, descending=True)
        before = ordered.softmax(dim=-1).cumsum(dim=-1) - ordered.softmax(dim=-1)  # mass of the tokens before
        cut = before >= options.top_p  # the nucleus: the first token always stays
        weights = weights.masked_fill(torch.empty_like(cut).scatter_(1, order, cut), float("-inf"))
    return weights


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row whose cumulative probability first exceeds ``u`` (inverse-CDF sampling)."""
    probs = (weights - weights.max(dim=-1, keepdim=True).values).double().exp()
    cumulative = probs.cumsum(dim=-1)
    target = (u * cumulative[:, -1]).unsqueeze(1)
    return torch.searchsorted(cumulative, target, right=True).squeeze(1).clamp(max=weights.size(-1) - 1)


@torch.no_grad()
def sample(
    model: Transformer | Sequence[Transformer],
    src: torch.Tensor,
    bos_id: int,
    eos_id: int,
    options: DecodingOptions,
    seed: int,
    sentences: torch.Tensor,
    n: int = 1,
) -> list[list[Hypothesis]]:
    """``n`` sampled translations of each sentence of a batch of source ids (B, S), in the order drawn.
    ``sentences`` (B,) number the sentences (their places in the input), which with ``seed`` decide the
    draws: a sentence gets the same samples in any batch.

    Outputs follow the same rules as beam search (at most source length + ``max_len_offset`` tokens,
    ``min_len``, ``no_repeat_ngram``, never PAD or BOS). Each hypothesis carries its log-probability
    under the model (before temperature and cuts) and that over its length penalty as its score.
    """
    if not whole(n, 1):
        raise FieldError("nbest", n, "must be a whole number of samples >= 1")
    decoder = Ensemble(model, options.ensemble)
    device, n_sent = src.device, src.size(0)
    max_len = (src.ne(decoder.pad_id).sum(dim=1) + options.max_len_offset).clamp(max=decoder.max_positions - 1)
    decoder.start(src, copies=n)
    rows = n_sent * n
    row_sentence = sentences.to(device=device, dtype=torch.long).repeat_interleave(n)
    row_sample = torch.arange(n, device=device).repeat(n_sent)
    row_limit = max_len.repeat_interleave(n)
    tokens = torch.full((rows, 1), bos_id, dtype=torch.long, device=device)
    log_prob = torch.zeros(rows, dtype=torch.float64, device=device)
    length = torch.zeros(rows, dtype=torch.long, device=device)
    live = torch.arange(rows, device=device)  # rows still drawing, in order
    never = torch.tensor(sorted({decoder.pad_id, bos_id}), device=device)
    outputs = torch.full((rows, int(max_len.max()) + 1), decoder.pad_id, dtype=torch.long, device=device)
    for step in range(int(max_len.max()) + 1):
        at_limit = row_limit[live].le(step)
        log_probs = step_rules(decoder.log_probs(tokens), tokens, step, at_limit, never, eos_id, options)
        token = draw(filtered(log_probs, options), uniform(seed, row_sentence[live], row_sample[live], step))
        log_prob[live] += log_probs.gather(1, token[:, None]).squeeze(1).double()
        outputs[live, step] = token
        ended = token.eq(eos_id)
        length[live[ended]] = step
        if bool(ended.all()):
            break
        keep = (~ended).nonzero().squeeze(1)
        live, tokens = live[keep], torch.cat([tokens[keep], token[keep, None]], dim=1)
        decoder.select(keep)
    lp = length_penalty((length + 1).double(), options.alpha, options.length_penalty)
    scores = (log_prob / lp).tolist()
    found = [
        Hypothesis(row[:size], score, total)
        for row, size, score, total in zip(outputs.tolist(), length.tolist(), scores, log_prob.tolist(), strict=True)
    ]
    return [found[i * n : (i + 1) * n] for i in range(n_sent)]
