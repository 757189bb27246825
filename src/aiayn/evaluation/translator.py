"""Text in, text out: a trained model, its tokenizer and the decoding options, batched by length."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import ConfigError, whole
from aiayn.export.ctranslate2 import EngineModel, engine_of, import_ctranslate2, is_engine_folder
from aiayn.model import PAPER_DECODING, DecodingOptions, Transformer, translate_ids
from aiayn.training.checkpoints import load_model

BACKENDS = ("auto", "aiayn", "ctranslate2")  # auto: the engine for an exported folder, ours for a .ckpt
CHARS_MARGIN = 2  # a line refused unread has more than twice the characters the model's tokens can hold


class Translator:
    """Translates lines of raw text with beam search as ``decoding`` says (the paper's by default).

    Lines are encoded with the model's own BPE, sorted by length and cut into batches of at most
    ``max_tokens`` source tokens (padding included), so that short sentences are not padded to long
    ones; results come back in input order. An empty line translates to an empty line.

    ``model`` is ours (decoded by :func:`aiayn.model.beam_search`) or an exported CTranslate2 model
    (decoded by the engine's beam search, with the same options; see :mod:`aiayn.export.ctranslate2`).
    """

    def __init__(
        self,
        model: Transformer | EngineModel,
        tokenizer: Tokenizer,
        decoding: DecodingOptions = PAPER_DECODING,
        max_tokens: int = 8192,
    ) -> None:
        if not whole(max_tokens, 1):
            raise ConfigError("max_tokens", max_tokens, "must be a whole number of source tokens >= 1")
        self.model = model.eval() if isinstance(model, Transformer) else model
        self.tokenizer, self.decoding, self.max_tokens = tokenizer, decoding, max_tokens
        self.max_source_tokens = model.cfg.max_positions - 1  # the encoder's position table, with room for EOS
        # Characters (spaces aside) that max_source_tokens pieces can hold, times the margin: a line near
        # the limit is left to the token count, whose message is exact.
        self.max_chars = CHARS_MARGIN * self.max_source_tokens * longest_piece(tokenizer)

    @classmethod
    def from_checkpoint(
        cls,
        path: Path,
        device: str | torch.device = "cpu",
        decoding: DecodingOptions = PAPER_DECODING,
        max_tokens: int = 8192,
    ) -> Translator:
        model, tokenizer, _ = load_translation_model(path, device=device)
        return cls(model, tokenizer, decoding, max_tokens)

    def translate(self, lines: Sequence[str], first_line: int = 1) -> list[str]:
        """Translations of ``lines``, in the same order; errors number lines from ``first_line``.

        A line longer than the model reads is a :class:`ValueError`. One with more characters (spaces
        aside) than :attr:`max_chars`, twice what the model's tokens can hold, is refused before it is
        tokenized: a 10 MB line costs a second of sentencepiece, and it cannot fit in tokens unless it
        is mostly characters the model has never seen (a run of those is one unknown token), which it
        cannot translate anyway.
        """
        lines = [line.strip() for line in lines]
        limit = self.max_source_tokens
        for number, line in enumerate(lines, start=first_line):
            chars = len(line) - line.count(" ")  # a run of spaces is one ▁ at most
            if chars > self.max_chars:
                raise ValueError(
                    f"line {number} has {chars} characters besides spaces: far more than the {limit} tokens "
                    "this model reads at most can hold"
                )
        ids = self.tokenizer.encode(lines)
        for number, row in enumerate(ids, start=first_line):
            if len(row) > limit:
                raise ValueError(f"line {number} has {len(row)} tokens; this model reads at most {limit}")
        order = sorted((i for i, row in enumerate(ids) if row), key=lambda i: len(ids[i]), reverse=True)
        outputs = [""] * len(lines)
        for batch in self._batches(order, ids):
            for i, text in zip(batch, self.tokenizer.decode(self.translate_ids([ids[i] for i in batch])), strict=True):
                outputs[i] = text
        return outputs

    def translate_blocks(self, lines: Iterable[str], block: int = 1000) -> Iterator[list[str]]:
        """Translate an unbounded stream ``block`` lines at a time (for pipes), in order."""
        if block < 1:
            raise ValueError(f"block={block}: translate at least 1 line at a time")
        iterator = iter(lines)
        first_line = 1
        while chunk := list(islice(iterator, block)):
            yield self.translate(chunk, first_line)
            first_line += len(chunk)

    def _batches(self, order: list[int], ids: list[list[int]]) -> Iterator[list[int]]:
        batch: list[int] = []
        for i in order:  # longest first: the first sentence of a batch sets its width
            width = len(ids[batch[0]] if batch else ids[i]) + 1
            if batch and (len(batch) + 1) * width > self.max_tokens:
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def translate_ids(self, rows: list[list[int]]) -> list[list[int]]:
        """The best hypothesis of each source (ids without EOS), by our beam search or the engine's."""
        if isinstance(self.model, EngineModel):
            return self.model.translate_ids(rows, self.decoding)
        tokenizer = self.tokenizer
        return translate_ids(self.model, self._source_tensor(rows), tokenizer.bos_id, tokenizer.eos_id, self.decoding)

    def _source_tensor(self, rows: list[list[int]]) -> torch.Tensor:
        """Source ids + EOS, right-padded, as the training batches are (see ``data.dataset.Collator``)."""
        width = max(len(row) for row in rows) + 1
        src = torch.full((len(rows), width), self.tokenizer.pad_id, dtype=torch.long)
        for r, row in enumerate(rows):
            src[r, : len(row)] = torch.tensor(row, dtype=torch.long)
            src[r, len(row)] = self.tokenizer.eos_id
        return src.to(next(self.model.parameters()).device)


def load_translation_model(
    path: Path, backend: str = "auto", device: str | torch.device = "cpu", compute_type: str = "default"
) -> tuple[Transformer | EngineModel, Tokenizer, dict[str, Any]]:
    """The model that ``checkpoint=`` names, its tokenizer and its run's config: a ``.ckpt`` decoded by
    ``backend`` (ours, or CTranslate2 after converting it on the fly), or a folder of ``aiayn-export
    format=ctranslate2``, decoded by the engine. ``compute_type`` is the engine's (int8, float32, ...)."""
    if backend not in BACKENDS:
        raise ConfigError("backend", backend, f"must be one of {', '.join(BACKENDS)}")
    if not isinstance(compute_type, str) or not compute_type:
        raise ConfigError("compute_type", compute_type, "must be a CTranslate2 compute type (default, int8, ...)")
    path = Path(path)
    if is_engine_folder(path):
        if backend == "aiayn":
            raise ConfigError(
                "backend", backend, f"cannot decode {path}, a CTranslate2 folder; use backend=ctranslate2"
            )
        engine = EngineModel(path, device, compute_type)
        return engine, engine.tokenizer, engine.run_config
    if compute_type != "default" and backend != "ctranslate2":
        raise ConfigError(
            "compute_type", compute_type, "is for backend=ctranslate2 (or an exported CTranslate2 folder)"
        )
    if backend == "ctranslate2":
        import_ctranslate2()  # a missing library is said before the checkpoint is read
    model, tokenizer, run_config = load_model(path, device)
    if backend == "ctranslate2":
        # The temporary engine folder's provenance gets no run config: the stored one is returned as it
        # is, and a shared checkpoint's values (bytes, any nesting) need not be JSON.
        return engine_of(model, tokenizer, {}, device, compute_type), tokenizer, run_config
    return model, tokenizer, run_config


def longest_piece(tokenizer: Tokenizer) -> int:
    """The most characters of text one piece of ``tokenizer`` stands for (its ▁ stands for a space)."""
    sp = tokenizer.sp
    pieces = (sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not (sp.is_control(i) or sp.is_unknown(i)))
    return max((len(piece.replace("▁", "")) for piece in pieces), default=1) or 1
