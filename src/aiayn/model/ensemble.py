"""Several models decoding as one: at each step the mean of their log-probabilities (an ensemble of
checkpoints or of seeds, standard in NMT papers; Marian averages log-probabilities likewise), or of their
probabilities (fairseq's). Each model
reads the source with its own encoder and keeps its own key/value caches; the members share the
vocabulary (a tokenizer), not their shapes. One model is an ensemble of one, through the same code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from aiayn.errors import FieldError
from aiayn.model.transformer import DecoderState, Transformer


class Ensemble:
    """The decoders of ``models`` stepping together over one batch of hypotheses: :meth:`start` encodes the
    source, :meth:`log_probs` scores the next token of every row, :meth:`select` keeps and reorders rows
    (beams that survive, sentences that are done)."""

    def __init__(self, models: Transformer | Sequence[Transformer], mean: str = "log_prob") -> None:
        self.models = [models] if isinstance(models, Transformer) else list(models)
        self.mean = mean  # "log_prob" or "prob" (DecodingOptions.ensemble)
        if not self.models:
            raise FieldError("models", [], "must hold at least one model")
        first = self.models[0].cfg
        for model in self.models[1:]:
            if (model.cfg.vocab_size, model.cfg.pad_id) != (first.vocab_size, first.pad_id):
                raise FieldError("models", len(self.models), "must share one vocabulary (one tokenizer)")
        self.pad_id, self.vocab_size = first.pad_id, first.vocab_size
        self.max_positions = min(model.cfg.max_positions for model in self.models)  # every decoder's table
        self.memories: list[torch.Tensor] = []
        self.paddings: list[torch.Tensor | None] = []
        self.states: list[DecoderState | None] = []

    def start(self, src: torch.Tensor, copies: int = 1, use_cache: bool = True) -> None:
        """Encode ``src`` (B, S) with every model; each sentence's encoder output is repeated ``copies``
        times (its beams or samples: rows ``b * copies`` to ``b * copies + copies - 1``)."""
        self.memories, self.paddings, self.states = [], [], []
        for model in self.models:
            memory, padding = model.encode(src)
            self.memories.append(memory.repeat_interleave(copies, dim=0))
            self.paddings.append(padding.repeat_interleave(copies, dim=0) if padding is not None else None)
            self.states.append(model.init_state() if use_cache else None)

    def log_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        """(rows, vocab) float32 log-probabilities of the token after ``tokens`` (rows, t: BOS and the tokens
        so far): the mean over the models of their log-probabilities, or with ``mean="prob"`` the log of
        the mean of their probabilities (fairseq's ensembles). With caches, only the last token is fed;
        without, the whole prefix is decoded again (the reference the cached path must equal)."""
        total: torch.Tensor | None = None
        for model, memory, padding, state in zip(self.models, self.memories, self.paddings, self.states, strict=True):
            step_input = tokens[:, -1:] if state is not None else tokens
            logits = model.decode(step_input, memory, padding, state, last_only=True)[:, -1]
            log_probs = logits.float().log_softmax(-1)
            if total is None:
                total = log_probs
            else:  # a running sum of the members' log-probabilities, or of their probabilities in log space
                total = torch.logaddexp(total, log_probs) if self.mean == "prob" else total + log_probs
        assert total is not None
        if len(self.models) == 1:
            return total
        return total - math.log(len(self.models)) if self.mean == "prob" else total / len(self.models)

    def select(self, rows: torch.Tensor, cross: bool = True) -> None:
        """Keep (and reorder) the batch rows ``rows``. ``cross=False``: the rows only moved within their
        sentences (beams), so the encoder outputs and the cross-attention caches stay as they are."""
        for i, state in enumerate(self.states):
            if cross:
                self.memories[i] = self.memories[i].index_select(0, rows)
                if self.paddings[i] is not None:
                    self.paddings[i] = self.paddings[i].index_select(0, rows)
            if state is not None:
                state.select(rows, cross=cross)
