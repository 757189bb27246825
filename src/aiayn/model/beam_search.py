"""Beam search as §6.1 runs it: beam size 4, length penalty α = 0.6, output length ≤ source length + 50;
and the n best hypotheses of each sentence, for reranking and minimum-risk training.

A finished hypothesis Y scores ``log P(Y | X) / lp(Y)`` (:func:`~aiayn.model.decoding_options.length_penalty`:
GNMT's by default, or ``power``), where ``|Y|`` counts the emitted tokens including EOS (as fairseq does).

Every step extends all live beams of all sentences in one batched decoder call through the key/value
caches (of every model, for an :class:`~aiayn.model.ensemble.Ensemble`). Of the best ``2 * beam_size``
extensions of a sentence, those ending in EOS among the best ``beam_size`` become finished hypotheses
(a sentence keeps its ``nbest`` best) and the best ``beam_size`` others stay live. A sentence stops only
when no live beam can still beat its ``nbest``-th finished hypothesis: a live beam's log-probability can
only fall, so its best possible score is its log-probability now over the largest length penalty it
could still reach. Finished sentences leave the batch, and the search ends when none is left.

They leave it in groups, so that the decoder's batch takes few sizes: the rows still searched stay a
multiple of :data:`SENTENCE_MULTIPLE` sentences, finished ones riding along (their extensions are never
kept) until enough have finished. Every new size of a matrix product costs its kernels: oneDNN builds and
caches them on the CPU (a cache that outgrew its capacity kept rebuilding them and fragmenting the heap of
long runs, aiayn.machine.size_kernel_caches), and a GPU builds graphs or compiled regions per shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aiayn.model.decoding_options import PAPER_DECODING, DecodingOptions, length_penalty, step_rules
from aiayn.model.ensemble import Ensemble
from aiayn.model.transformer import Transformer

# Finished sentences leave the batch only as many at a time as keep the rest a multiple of this (or all).
SENTENCE_MULTIPLE = 8


@dataclass(frozen=True)
class Hypothesis:
    """A translation without BOS and EOS, its length-normalised score and its log-probability."""

    tokens: list[int]
    score: float
    log_prob: float


@torch.no_grad()
def beam_search(
    model: Transformer | Sequence[Transformer],
    src: torch.Tensor,
    bos_id: int,
    eos_id: int,
    options: DecodingOptions = PAPER_DECODING,
    use_cache: bool = True,
) -> list[Hypothesis]:
    """The best hypothesis for each sentence of a batch of source ids (B, S); see :func:`nbest_search`."""
    return [found[0] for found in nbest_search(model, src, bos_id, eos_id, options, 1, use_cache)]


@torch.no_grad()
def nbest_search(
    model: Transformer | Sequence[Transformer],
    src: torch.Tensor,
    bos_id: int,
    eos_id: int,
    options: DecodingOptions = PAPER_DECODING,
    nbest: int = 1,
    use_cache: bool = True,
) -> list[list[Hypothesis]]:
    """The ``nbest`` (≤ beam size) best finished hypotheses of each sentence of a batch of source ids
    (B, S), padded with ``pad_id``, best first, by ``model`` or by an ensemble of models (a sequence).

    With ``options.beam_size`` beams, sentence ``b`` emits at most ``len(src[b]) + options.max_len_offset``
    tokens before EOS; at that length EOS is forced. ``use_cache=False`` re-runs the decoder over the whole
    prefix at every step instead of reading the key/value caches (the reference that the cached path
    must equal, and a benchmark).
    PAD and BOS are never generated. One beam is greedy decoding: the arg-max token at every step and no
    length penalty (as beam size 1 means in fairseq and Hugging Face), so ``alpha`` is ignored then.
    """
    options.check_nbest(nbest)
    k = options.beam_size
    # With α = 0 the first EOS that is the arg-max can no longer be beaten: one beam is greedy.
    alpha, penalty = (0.0 if k == 1 else options.alpha), options.length_penalty
    decoder = Ensemble(model, options.ensemble)
    pad_id, device, n_sent = decoder.pad_id, src.device, src.size(0)
    # (B,) tokens allowed before EOS; the decoder's position tables (BOS + tokens) bound them as well.
    max_len = (src.ne(pad_id).sum(dim=1) + options.max_len_offset).clamp(max=decoder.max_positions - 1)
    decoder.start(src, copies=k, use_cache=use_cache)  # every beam of a sentence reads the same source

    tokens = torch.full((n_sent * k, 1), bos_id, dtype=torch.long, device=device)
    # Only the first copy of the empty prefix is live, so the first step does not fill the beam with duplicates.
    scores = torch.full((n_sent, k), float("-inf"), device=device)
    scores[:, 0] = 0.0
    active = torch.arange(n_sent, device=device)  # sentence ids still searched, in batch order
    riding = torch.zeros(n_sent, dtype=torch.bool, device=device)  # finished, kept for the batch's size
    longest = int(max_len.max())
    # The nbest finished hypotheses of each sentence, best first.
    found_score = torch.full((n_sent, nbest), float("-inf"), device=device)
    found_log_prob = torch.full((n_sent, nbest), float("-inf"), device=device)
    found_len = torch.zeros(n_sent, nbest, dtype=torch.long, device=device)
    found_tokens = torch.full((n_sent, nbest, longest), pad_id, dtype=torch.long, device=device)
    never = torch.tensor(sorted({pad_id, bos_id}), device=device)

    for step in range(longest + 1):
        n = active.numel()
        at_limit = max_len[active].le(step).repeat_interleave(k)  # (n * k,) these rows must end now
        log_probs = step_rules(decoder.log_probs(tokens), tokens, step, at_limit, never, eos_id, options)
        vocab = log_probs.size(-1)
        candidates = (scores[:, :, None] + log_probs.view(n, k, vocab)).view(n, k * vocab)
        cand_scores, cand_index = candidates.topk(min(2 * k, k * vocab), dim=1)  # best first
        cand_beam, cand_token = cand_index // vocab, cand_index % vocab
        ends = cand_token.eq(eos_id)

        # EOS extensions ranked among the best k become finished hypotheses.
        finishing = ends & cand_scores.isfinite() & ~riding[:, None]
        finishing[:, k:] = False
        if bool(finishing.any()):
            normalized = cand_scores / length_penalty(float(step + 1), alpha, penalty)
            keep_found(
                found_score, found_log_prob, found_len, found_tokens, active,
                normalized.masked_fill(~finishing, float("-inf")), cand_scores,
                tokens.view(n, k, -1)[:, :, 1:].gather(
                    1, cand_beam[:, :, None].expand(-1, -1, step)
                ) if step else tokens.new_zeros(n, cand_beam.size(1), 0),
                step,
            )  # fmt: skip

        # The best k extensions that do not end stay live.
        scores, live_pos = cand_scores.masked_fill(ends, float("-inf")).topk(k, dim=1)  # (n, k)
        beam, token = cand_beam.gather(1, live_pos), cand_token.gather(1, live_pos)
        # A live beam may still end at any length up to max_len + 1, and lp grows with length (α >= 0).
        largest_penalty = length_penalty((max_len[active] + 1).float(), alpha, penalty)
        done = riding | (found_score[active, -1] >= scores[:, 0] / largest_penalty)

        rows = (torch.arange(n, device=device)[:, None] * k + beam).view(-1)  # new beam → old row
        tokens = torch.cat([tokens[rows], token.view(-1, 1)], dim=1)
        searched = n - int(done.sum())
        if searched == 0:
            break
        kept = min(n, -(-searched // SENTENCE_MULTIPLE) * SENTENCE_MULTIPLE)
        if kept < n:
            # All sentences still searched, and the first finished ones as far as the multiple needs.
            keep = torch.cat([(~done).nonzero().squeeze(1), done.nonzero().squeeze(1)[: kept - searched]]).sort()[0]
            kept_rows = (keep[:, None] * k + torch.arange(k, device=device)).view(-1)
            active, scores, tokens, rows = active[keep], scores[keep], tokens[kept_rows], rows[kept_rows]
            riding = done[keep]
            decoder.select(rows)
        else:
            riding = done
            if k > 1:
                decoder.select(rows, cross=False)  # beams only moved within their sentences

    lengths, found = found_len.tolist(), zip(found_score.tolist(), found_log_prob.tolist(), strict=True)
    return [
        [
            Hypothesis(row[:length], score, log_prob)
            for row, length, score, log_prob in zip(rows, sentence_lengths, scores, log_probs, strict=True)
            if score > float("-inf")
        ]
        for rows, sentence_lengths, (scores, log_probs) in zip(found_tokens.tolist(), lengths, found, strict=True)
    ]


def keep_found(
    found_score: torch.Tensor,
    found_log_prob: torch.Tensor,
    found_len: torch.Tensor,
    found_tokens: torch.Tensor,
    active: torch.Tensor,
    new_score: torch.Tensor,
    new_log_prob: torch.Tensor,
    new_tokens: torch.Tensor,
    step: int,
) -> None:
    """Merge the finished candidates of this step (``new_*``: (n, c), scored -inf where not finishing;
    ``new_tokens`` (n, c, step)) into the ``nbest`` best of the active sentences, in place. The sort is
    stable and the earlier ones come first: of equal scores, the hypothesis found first stays ahead."""
    nbest = found_score.size(1)
    merged = torch.cat([found_score[active], new_score], dim=1)  # (n, nbest + c)
    order = merged.sort(dim=1, descending=True, stable=True).indices[:, :nbest]
    is_new, new_pos = order >= nbest, (order - nbest).clamp(min=0)
    old_pos = order.clamp(max=nbest - 1)
    found_score[active] = merged.gather(1, order)
    found_log_prob[active] = torch.where(
        is_new, new_log_prob.gather(1, new_pos), found_log_prob[active].gather(1, old_pos)
    )
    found_len[active] = torch.where(is_new, step, found_len[active].gather(1, old_pos))
    longest = found_tokens.size(2)
    new_rows = torch.nn.functional.pad(new_tokens, (0, longest - step))  # read up to each length only
    old = found_tokens[active].gather(1, old_pos[:, :, None].expand(-1, -1, longest))
    fresh = new_rows.gather(1, new_pos[:, :, None].expand(-1, -1, longest))
    found_tokens[active] = torch.where(is_new[:, :, None], fresh, old)
