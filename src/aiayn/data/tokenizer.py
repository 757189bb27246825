"""The joint source-target sentencepiece BPE model (§5.1: a shared vocabulary, needed by §3.4)."""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm

from aiayn.errors import FieldError
from aiayn.files import atomic_write
from aiayn.machine import available_cpus

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class Tokenizer:
    """A trained sentencepiece model: text ↔ ids, with fixed special ids (pad 0, unk 1, bos 2, eos 3)."""

    pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID

    def __init__(self, model_file: Path) -> None:
        self.model_file: Path | None = Path(model_file)
        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))

    @classmethod
    def from_bytes(cls, model: bytes) -> Tokenizer:
        """The tokenizer whose serialized model :meth:`to_bytes` gave (checkpoints carry it this way)."""
        tokenizer = cls.__new__(cls)
        tokenizer.model_file = None
        tokenizer.sp = spm.SentencePieceProcessor(model_proto=model)
        return tokenizer

    def to_bytes(self) -> bytes:
        return self.sp.serialized_model_proto()

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, lines: Sequence[str], threads: int | None = None) -> list[list[int]]:
        """Ids of each line, encoded by ``threads`` native threads (default: one per CPU)."""
        return self.sp.encode(list(lines), out_type=int, num_threads=threads or available_cpus())

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return self.sp.decode([list(row) for row in ids])

    @classmethod
    def train(cls, lines: Iterable[str], vocab_size: int, model_file: Path, symbols: Sequence[str] = ()) -> Tokenizer:
        """Train a BPE model on ``lines`` and write it atomically to ``model_file``; ``symbols`` (tags such as
        back-translation's ``<BT>``) become single pieces, ids 4, 5, ..., never split.

        The model is serialized in memory, not through sentencepiece's ``model_prefix``, which it would
        store inside the model: the same lines give the same bytes, whoever trains them and where.
        """
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(lines),
                model_writer=model,
                model_type="bpe",
                vocab_size=vocab_size,
                character_coverage=1.0,
                # identity keeps the text as written, so decoding gives back the reference's characters
                normalization_rule_name="identity",
                pad_id=PAD_ID,
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                user_defined_symbols=list(symbols),
                num_threads=available_cpus(),
                minloglevel=2,
            )
        except RuntimeError as error:  # the corpus cannot have this many pieces, or needs more
            reason = ". ".join(str(error).split("] ", 1)[-1].split(". ")[:2]).rstrip(".")
            raise FieldError("vocab_size", vocab_size, f"does not suit this corpus: {reason}") from None
        atomic_write(Path(model_file), model.getvalue())
        return cls(model_file)
