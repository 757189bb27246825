"""The hyperparameters of the Transformer (§3, Table 3 columns)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from aiayn.errors import FieldError, is_number, whole

POSITIONAL_ENCODINGS = ("sinusoidal", "learned", "none", "rope")


@dataclass
class TransformerConfig:
    """Every size the paper's Table 3 varies, plus the variants people ablate.

    ``d_k`` and ``d_v`` are free: rows (B) of Table 3 change ``d_k`` alone, so ``h * d_k`` need not
    equal ``d_model`` (§3.2.2). A value the model cannot use raises :class:`~aiayn.errors.FieldError`
    naming the field (``d_model=511 must be even for positional=sinusoidal``).
    """

    vocab_size: int
    n_layers: int = 6
    d_model: int = 512
    d_ff: int = 2048
    n_heads: int = 8
    d_k: int = 64
    d_v: int = 64
    dropout: float = 0.1
    attn_dropout: float = 0.0
    activation_dropout: float = 0.0
    positional: str = "sinusoidal"
    norm_first: bool = False
    share_embeddings: bool = True
    max_positions: int = 1024
    pad_id: int = 0

    def __post_init__(self) -> None:
        for key in ("vocab_size", "n_layers", "d_model", "d_ff", "n_heads", "d_k", "d_v", "max_positions"):
            value = getattr(self, key)
            if not whole(value, 1):
                raise FieldError(key, value, "must be a positive whole number")
        if not whole(self.pad_id, 0) or self.pad_id >= self.vocab_size:
            raise FieldError("pad_id", self.pad_id, f"must be a token id in [0, vocab_size={self.vocab_size})")
        for key in ("dropout", "attn_dropout", "activation_dropout"):
            value = getattr(self, key)
            if not is_number(value) or not 0.0 <= value < 1.0:
                raise FieldError(key, value, "must be a probability in [0, 1)")
        for key in ("norm_first", "share_embeddings"):
            if not isinstance(getattr(self, key), bool):
                raise FieldError(key, getattr(self, key), "must be true or false")
        if self.positional not in POSITIONAL_ENCODINGS:
            raise FieldError("positional", self.positional, f"must be one of {', '.join(POSITIONAL_ENCODINGS)}")
        # Sinusoids come in sine/cosine pairs, one pair per two dimensions (§3.5); rotations turn pairs of d_k.
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise FieldError("d_model", self.d_model, "must be even for positional=sinusoidal")
        if self.positional == "rope" and self.d_k % 2:
            raise FieldError("d_k", self.d_k, "must be even for positional=rope")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
