"""Beam search as §6.1 runs it: beam size 4, length penalty α = 0.6, output length ≤ source length + 50.

The length penalty is GNMT's (Wu et al., 2016, eq. 14): a finished hypothesis Y scores
``log P(Y | X) / lp(Y)`` with ``lp(Y) = ((5 + |Y|) / 6) ** α``, where ``|Y|`` counts the emitted tokens
including EOS (as fairseq does).

Every step extends all live beams of all sentences in one batched decoder call through the key/value
caches. Of the best ``2 * beam_size`` extensions of a sentence, those ending in EOS among the best
``beam_size`` become finished hypotheses and the best ``beam_size`` others stay live. A sentence stops
only when no live beam can still beat its best finished hypothesis: a live beam's log-probability can
only fall, so its best possible score is its log-probability now over the largest length penalty it
could still reach. Finished sentences leave the batch, and the search ends when none is left.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from aiayn.errors import FieldError, is_number, whole
from aiayn.model.transformer import Transformer


@dataclass(frozen=True)
class DecodingOptions:
    """How a translation is searched for (§6.1): ``beam_size`` hypotheses (1: greedy), the length penalty
    ``alpha`` and at most source length + ``max_len_offset`` output tokens; the paper's by default.

    Checked once, where it is made; validation, test, the dashboard's samples, ``aiayn-eval`` and
    ``aiayn-translate`` pass it whole.
    """

    beam_size: int = 4
    alpha: float = 0.6
    max_len_offset: int = 50

    def __post_init__(self) -> None:
        if not whole(self.beam_size, 1):
            raise FieldError("beam_size", self.beam_size, "must be a whole number >= 1 (1 is greedy decoding)")
        if not is_number(self.alpha) or self.alpha < 0:
            raise FieldError("alpha", self.alpha, "must be a number >= 0 (0: no length penalty; the paper uses 0.6)")
        if not whole(self.max_len_offset, 0):
            raise FieldError("max_len_offset", self.max_len_offset, "must be a whole number >= 0 (the paper uses 50)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PAPER_DECODING = DecodingOptions()  # §6.1: beam 4, α = 0.6, at most source length + 50 tokens


@dataclass(frozen=True)
class Hypothesis:
    """A translation without BOS and EOS, its length-normalised score and its log-probability."""

    tokens: list[int]
    score: float
    log_prob: float


def length_penalty(length: torch.Tensor | float, alpha: float) -> torch.Tensor | float:
    """GNMT's ``((5 + |Y|) / 6) ** α``; α = 0 gives 1 (plain log-probability)."""
    return ((5.0 + length) / 6.0) ** alpha


@torch.no_grad()
def beam_search(
    model: Transformer,
    src: torch.Tensor,
    bos_id: int,
    eos_id: int,
    options: DecodingOptions = PAPER_DECODING,
    use_cache: bool = True,
) -> list[Hypothesis]:
    """The best hypothesis for each sentence of a batch of source ids (B, S), padded with ``pad_id``.

    With ``options.beam_size`` beams, sentence ``b`` emits at most ``len(src[b]) + options.max_len_offset``
    tokens before EOS; at that length EOS is forced. ``use_cache=False`` re-runs the decoder over the whole
    prefix at every step instead of reading the key/value caches (the reference that the cached path
    must equal, and a benchmark).
    PAD and BOS are never generated. One beam is greedy decoding: the arg-max token at every step and no
    length penalty (as beam size 1 means in fairseq and Hugging Face), so ``alpha`` is ignored then.
    """
    beam_size, alpha, max_len_offset = options.beam_size, options.alpha, options.max_len_offset
    if beam_size == 1:
        alpha = 0.0  # with α = 0 the first EOS that is the arg-max can no longer be beaten: greedy
    pad_id, k = model.cfg.pad_id, beam_size
    device, n_sent = src.device, src.size(0)
    # (B,) tokens allowed before EOS; the decoder's position tables (BOS + tokens) bound them as well.
    max_len = (src.ne(pad_id).sum(dim=1) + max_len_offset).clamp(max=model.cfg.max_positions - 1)
    memory, src_padding = model.encode(src)
    # Every beam of a sentence attends to the same encoder output: repeat it once per beam.
    memory = memory.repeat_interleave(k, dim=0)  # (B*k, S, d_model)
    if src_padding is not None:
        src_padding = src_padding.repeat_interleave(k, dim=0)
    state = model.init_state() if use_cache else None

    tokens = torch.full((n_sent * k, 1), bos_id, dtype=torch.long, device=device)
    # Only the first copy of the empty prefix is live, so the first step does not fill the beam with duplicates.
    scores = torch.full((n_sent, k), float("-inf"), device=device)
    scores[:, 0] = 0.0
    active = torch.arange(n_sent, device=device)  # sentence ids still searched, in batch order
    best_score = torch.full((n_sent,), float("-inf"), device=device)
    best_log_prob = torch.full((n_sent,), float("-inf"), device=device)
    best_len = torch.zeros(n_sent, dtype=torch.long, device=device)
    longest = int(max_len.max())
    best_tokens = torch.full((n_sent, longest), pad_id, dtype=torch.long, device=device)
    never = torch.tensor(sorted({pad_id, bos_id}), device=device)

    for step in range(longest + 1):
        n = active.numel()
        step_input = tokens[:, -1:] if use_cache else tokens
        logits = model.decode(step_input, memory, src_padding, state, last_only=True)[:, -1]
        log_probs = logits.float().log_softmax(dim=-1)
        log_probs.index_fill_(1, never, float("-inf"))
        vocab = log_probs.size(-1)
        log_probs = log_probs.view(n, k, vocab)
        at_limit = max_len[active].le(step)  # (n,) these sentences must end now
        if bool(at_limit.any()):
            eos = log_probs[:, :, eos_id].clone()
            log_probs[at_limit] = float("-inf")
            log_probs[:, :, eos_id] = eos

        candidates = (scores[:, :, None] + log_probs).view(n, k * vocab)
        cand_scores, cand_index = candidates.topk(min(2 * k, k * vocab), dim=1)  # best first
        cand_beam, cand_token = cand_index // vocab, cand_index % vocab
        ends = cand_token.eq(eos_id)

        # EOS extensions ranked among the best k become finished hypotheses.
        finishing = ends & cand_scores.isfinite()
        finishing[:, k:] = False
        normalized = (cand_scores / length_penalty(float(step + 1), alpha)).masked_fill(~finishing, float("-inf"))
        top_normalized, top_pos = normalized.max(dim=1)
        improved = top_normalized > best_score[active]
        if bool(improved.any()):
            where = improved.nonzero().squeeze(1)
            sent = active[where]
            best_score[sent] = top_normalized[where]
            best_log_prob[sent] = cand_scores[where, top_pos[where]]
            best_len[sent] = step
            best_tokens[sent, :step] = tokens[where * k + cand_beam[where, top_pos[where]], 1:]

        # The best k extensions that do not end stay live.
        scores, live_pos = cand_scores.masked_fill(ends, float("-inf")).topk(k, dim=1)  # (n, k)
        beam, token = cand_beam.gather(1, live_pos), cand_token.gather(1, live_pos)
        # A live beam may still end at any length up to max_len + 1, and lp grows with length (α >= 0).
        largest_penalty = length_penalty((max_len[active] + 1).float(), alpha)
        done = best_score[active] >= scores[:, 0] / largest_penalty

        rows = (torch.arange(n, device=device)[:, None] * k + beam).view(-1)  # new beam → old row
        tokens = torch.cat([tokens[rows], token.view(-1, 1)], dim=1)
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            kept_rows = (keep[:, None] * k + torch.arange(k, device=device)).view(-1)
            active, scores, tokens, rows = active[keep], scores[keep], tokens[kept_rows], rows[kept_rows]
            memory = memory.index_select(0, rows)
            if src_padding is not None:
                src_padding = src_padding.index_select(0, rows)
            if state is not None:
                state.select(rows)
        elif state is not None and k > 1:
            state.select(rows, cross=False)  # beams only moved within their sentences

    lengths, score_list, log_prob_list = best_len.tolist(), best_score.tolist(), best_log_prob.tolist()
    return [
        Hypothesis(row[:length], score, log_prob)
        for row, length, score, log_prob in zip(best_tokens.tolist(), lengths, score_list, log_prob_list, strict=True)
    ]
