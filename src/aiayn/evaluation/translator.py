"""Text in, text out: a trained model, its tokenizer and the decoding options, batched by length."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import CheckpointError, FieldError, show, whole
from aiayn.evaluation.mbr import mbr_ranked
from aiayn.export.ctranslate2 import EngineModel, engine_of, import_ctranslate2, is_engine_folder
from aiayn.model import (
    DEFAULT_SDPA_BACKENDS,
    PAPER_DECODING,
    DecodingOptions,
    Hypothesis,
    Transformer,
    search,
    use_sdpa_backends,
)
from aiayn.training.checkpoints import load_model

BACKENDS = ("auto", "aiayn", "ctranslate2")  # auto: the engine for an exported folder, ours for a .ckpt
CHARS_MARGIN = 2  # a line refused unread has more than twice the characters the model's tokens can hold


@dataclass(frozen=True)
class Candidate:
    """One translation of a line: its text, its length-normalised score and its log-probability."""

    text: str
    score: float
    log_prob: float


def nbest_jsonl(found: Sequence[Sequence[Candidate]], first_line: int = 0, ensemble: str | None = None) -> str:
    """The n-best (or sampled) translations of consecutive lines as JSON lines, one object per translation:
    ``{"line", "rank", "text", "score", "log_prob"}``; ``line`` counts from 0 in the input (the first of
    ``found`` is line ``first_line``), ``rank`` from 1; an empty line has none. An ensemble's say how its
    members' scores were combined (``"ensemble": "log_prob"`` or ``"prob"``, :attr:`Translator.ensemble`).
    ``aiayn-translate nbest=`` and ``aiayn-eval nbest=`` write this format."""
    combined = {"ensemble": ensemble} if ensemble else {}
    return "".join(
        json.dumps({"line": first_line + i, "rank": rank, **asdict(candidate), **combined}, ensure_ascii=False) + "\n"
        for i, candidates in enumerate(found)
        for rank, candidate in enumerate(candidates, start=1)
    )


class Translator:
    """Translates lines of raw text as ``decoding`` says (the paper's beam search by default; sampling
    with ``decoding.sample``), ``nbest`` translations per line where asked.

    Lines are encoded with the model's own BPE, sorted by length and cut into batches of at most
    ``max_tokens`` source tokens (padding included), so that short sentences are not padded to long
    ones; results come back in input order. An empty line translates to an empty line. A sampled line's
    draws depend on ``seed`` and its number in the input only, not on its batch.

    ``model`` is ours (decoded by :func:`aiayn.model.search`), several of ours (an ensemble: the mean of
    their log-probabilities at each step), or an exported CTranslate2 model (decoded by the engine with
    the same options; see :mod:`aiayn.export.ctranslate2`).

    Our models decode with the attention kernels ``sdpa_backends`` allows, set for the whole process when
    the translator is made (:func:`aiayn.model.use_sdpa_backends`; cuDNN's is not among the default's:
    beam search brings a new key length every step, and cuDNN builds a graph for each).
    """

    def __init__(
        self,
        model: Transformer | Sequence[Transformer] | EngineModel,
        tokenizer: Tokenizer,
        decoding: DecodingOptions = PAPER_DECODING,
        max_tokens: int = 8192,
        nbest: int = 1,
        seed: int = 0,
        sdpa_backends: Sequence[str] = DEFAULT_SDPA_BACKENDS,
    ) -> None:
        check_translation(decoding, max_tokens, nbest, seed)
        self.models = [model] if isinstance(model, Transformer | EngineModel) else list(model)
        if len(self.models) > 1 and any(isinstance(member, EngineModel) for member in self.models):
            raise FieldError("backend", "ctranslate2", "decodes one model; an ensemble decodes with backend=aiayn")
        use_sdpa_backends(sdpa_backends)
        self.sdpa_backends = tuple(sdpa_backends)
        for member in self.models:
            if isinstance(member, Transformer):
                member.eval()
        self.model = self.models[0] if len(self.models) == 1 else self.models
        self.tokenizer, self.decoding, self.max_tokens = tokenizer, decoding, max_tokens
        self.nbest, self.seed = nbest, seed
        # the encoders' position tables, with room for EOS
        self.max_source_tokens = min(member.cfg.max_positions for member in self.models) - 1
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

    def varied(self, decoding: DecodingOptions | None = None, nbest: int | None = None) -> Translator:
        """A translator of the same model(s) and tokenizer, batches and seed, with another ``decoding`` or
        ``nbest``."""
        return Translator(
            self.model,
            self.tokenizer,
            self.decoding if decoding is None else decoding,
            self.max_tokens,
            self.nbest if nbest is None else nbest,
            self.seed,
            self.sdpa_backends,
        )

    @property
    def ensemble(self) -> str | None:
        """How the members' log-probabilities combine (``decoding.ensemble``); None for one model."""
        return self.decoding.ensemble if len(self.models) > 1 else None

    def translate(self, lines: Sequence[str], first_line: int = 1) -> list[str]:
        """Translations of ``lines`` (the best, or the first sample), in the same order; see :meth:`candidates`."""
        return [found[0].text if found else "" for found in self.candidates(lines, first_line)]

    def candidates(self, lines: Sequence[str], first_line: int = 1) -> list[list[Candidate]]:
        """The ``nbest`` translations of each of ``lines`` (best first; samples in the order drawn), in the
        same order; errors number lines from ``first_line``, which also numbers them for sampling.

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
        outputs: list[list[Candidate]] = [[] for _ in lines]
        for batch in self._batches(order, ids):
            found = self.search_ids([ids[i] for i in batch], [first_line - 1 + i for i in batch])
            for i, hypotheses in zip(batch, found, strict=True):
                texts = self.tokenizer.decode([hypothesis.tokens for hypothesis in hypotheses])
                outputs[i] = [Candidate(t, h.score, h.log_prob) for t, h in zip(texts, hypotheses, strict=True)]
                if self.decoding.mbr:  # the candidates by expected utility (aiayn.evaluation.mbr)
                    outputs[i] = mbr_ranked(outputs[i], self.decoding.mbr)[: self.nbest]
        return outputs

    def translate_blocks(self, lines: Iterable[str], block: int = 1000) -> Iterator[list[list[Candidate]]]:
        """Translate an unbounded stream ``block`` lines at a time (for pipes), in order: each line's
        :meth:`candidates`."""
        if block < 1:
            raise ValueError(f"block={block}: translate at least 1 line at a time")
        iterator = iter(lines)
        first_line = 1
        while chunk := list(islice(iterator, block)):
            yield self.candidates(chunk, first_line)
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

    def search_ids(self, rows: list[list[int]], numbers: list[int]) -> list[list[Hypothesis]]:
        """The ``nbest`` hypotheses of each source (ids without EOS; ``numbers``: the lines' places in the
        input, 0 first), by our search or the engine's; with ``decoding.mbr``, every MBR candidate (the
        beam's ``mbr_nbest`` best, then ``mbr_samples`` draws)."""
        if isinstance(self.model, EngineModel):
            return self.model.search(rows, self.decoding, self.nbest, self.seed)
        bos, eos, sentences = self.tokenizer.bos_id, self.tokenizer.eos_id, torch.tensor(numbers, dtype=torch.long)
        src, options = self._source_tensor(rows), self.decoding
        if not options.mbr:
            return search(self.model, src, bos, eos, options, self.nbest, self.seed, sentences)
        plain = replace(options, mbr=None)
        drawn = replace(plain, sample=True, beam_size=1)
        found: list[list[Hypothesis]] = [[] for _ in rows]
        for how, count in ((plain, options.mbr_beam), (drawn, options.mbr_samples)):
            if count:
                made = search(self.model, src, bos, eos, how, count, self.seed, sentences)
                for candidates, more in zip(found, made, strict=True):
                    candidates.extend(more)
        return found

    def _source_tensor(self, rows: list[list[int]]) -> torch.Tensor:
        """Source ids + EOS, right-padded, as the training batches are (see ``data.dataset.Collator``)."""
        width = max(len(row) for row in rows) + 1
        src = torch.full((len(rows), width), self.tokenizer.pad_id, dtype=torch.long)
        for r, row in enumerate(rows):
            src[r, : len(row)] = torch.tensor(row, dtype=torch.long)
            src[r, len(row)] = self.tokenizer.eos_id
        return src.to(next(self.models[0].parameters()).device)


def check_translation(decoding: DecodingOptions, max_tokens: int, nbest: int, seed: int) -> None:
    """A :class:`Translator`'s arguments: batches of at least one token, ``nbest`` translations the
    search can give (:meth:`~aiayn.model.DecodingOptions.check_nbest`), a whole-number seed."""
    if not whole(max_tokens, 1):
        raise FieldError("max_tokens", max_tokens, "must be a whole number of source tokens >= 1")
    decoding.check_nbest(nbest)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise FieldError("seed", seed, "must be a whole number")


def check_backend(backend: str, compute_type: str) -> None:
    """``backend`` is one of :data:`BACKENDS`; ``compute_type`` names CTranslate2's arithmetic."""
    if backend not in BACKENDS:
        raise FieldError("backend", backend, f"must be one of {', '.join(BACKENDS)}")
    if not isinstance(compute_type, str) or not compute_type:
        raise FieldError("compute_type", compute_type, "must be a CTranslate2 compute type (default, int8, ...)")


def load_translation_model(
    path: Path, backend: str = "auto", device: str | torch.device = "cpu", compute_type: str = "default"
) -> tuple[Transformer | EngineModel, Tokenizer, dict[str, Any]]:
    """The model that ``checkpoint=`` names, its tokenizer and its run's config: a ``.ckpt`` decoded by
    ``backend`` (ours, or CTranslate2 after converting it on the fly), or a folder of ``aiayn-export
    format=ctranslate2``, decoded by the engine. ``compute_type`` is the engine's (int8, float32, ...)."""
    check_backend(backend, compute_type)
    path = Path(path)
    if is_engine_folder(path):
        if backend == "aiayn":
            raise FieldError("backend", backend, f"cannot decode {path}, a CTranslate2 folder; use backend=ctranslate2")
        engine = EngineModel(path, device, compute_type)
        return engine, engine.tokenizer, engine.run_config
    if compute_type != "default" and backend != "ctranslate2":
        raise FieldError("compute_type", compute_type, "is for backend=ctranslate2 (or an exported CTranslate2 folder)")
    if backend == "ctranslate2":
        import_ctranslate2()  # a missing library is said before the checkpoint is read
    model, tokenizer, run_config = load_model(path, device)
    if backend == "ctranslate2":
        # The temporary engine folder's provenance gets no run config: the stored one is returned as it
        # is, and a shared checkpoint's values (bytes, any nesting) need not be JSON.
        return engine_of(model, tokenizer, {}, device, compute_type), tokenizer, run_config
    return model, tokenizer, run_config


def load_translation_models(
    paths: Sequence[Path], backend: str = "auto", device: str | torch.device = "cpu", compute_type: str = "default"
) -> tuple[Transformer | list[Transformer] | EngineModel, Tokenizer, dict[str, Any]]:
    """:func:`load_translation_model` for one checkpoint; for several, an ensemble of our models (the run
    config is the first's). The members must share the tokenizer (hence the vocabulary) and the direction;
    their shapes may differ. CTranslate2 decodes one model: an ensemble is ours."""
    if len(paths) == 1:
        return load_translation_model(paths[0], backend, device, compute_type)
    if backend == "ctranslate2" or compute_type != "default" or any(is_engine_folder(Path(p)) for p in paths):
        raise FieldError("checkpoint", [str(p) for p in paths], "of several is an ensemble of .ckpt files, "
                          "decoded by backend=aiayn (CTranslate2 decodes one model)")  # fmt: skip
    models, first_tokenizer, first_config = [], None, {}
    for path in paths:
        model, tokenizer, run_config = load_model(Path(path), device)
        if first_tokenizer is None:
            first_tokenizer, first_config = tokenizer, run_config
        elif tokenizer.to_bytes() != first_tokenizer.to_bytes():
            raise FieldError("checkpoint", str(path), f"has another tokenizer than {paths[0]}; an ensemble's "
                              "members share one (the same corpus and vocabulary)")  # fmt: skip
        elif (this := direction(run_config, path)) != (first := direction(first_config, paths[0])):
            shown = ["→".join(pair) if pair else None for pair in (this, first)]
            allowed = f"translates {shown[0]}, {paths[0]} {shown[1]}; an ensemble's members translate one direction"
            raise FieldError("checkpoint", str(path), allowed)
        models.append(model)
    assert first_tokenizer is not None
    return models, first_tokenizer, first_config


def direction(run_config: dict[str, Any], checkpoint: Path) -> tuple[str, str] | None:
    """(source language, target language) of a checkpoint's run, when its config says; a stored
    language that is not a string is a :class:`CheckpointError` naming it."""
    data = run_config.get("data") if isinstance(run_config, dict) else None
    if not isinstance(data, dict) or data.get("src_lang") is None or data.get("tgt_lang") is None:
        return None
    for key in ("src_lang", "tgt_lang"):
        if not isinstance(data[key], str) or not data[key].strip():
            raise CheckpointError(
                f"checkpoint {checkpoint}: its stored data.{key}={show(data[key])} is not a language code; "
                "a checkpoint aiayn-train wrote holds one (en, de, ...)"
            )
    return data["src_lang"], data["tgt_lang"]


def longest_piece(tokenizer: Tokenizer) -> int:
    """The most characters of text one piece of ``tokenizer`` stands for (its ▁ stands for a space)."""
    sp = tokenizer.sp
    pieces = (sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not (sp.is_control(i) or sp.is_unknown(i)))
    return max((len(piece.replace("▁", "")) for piece in pieces), default=1) or 1
