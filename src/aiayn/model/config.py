"""The hyperparameters of the Transformer (§3, Table 3 columns)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from aiayn.errors import FieldError, is_number, whole
from aiayn.model.components import POSITIONAL_NAMES, POSITIONAL_TARGETS, spec, target_of

# The names model.positional takes; a spec {_target_: ...} names any other positional component.
POSITIONAL_ENCODINGS = tuple(POSITIONAL_NAMES)


@dataclass
class TransformerConfig:
    """Every size the paper's Table 3 varies, plus the variants people ablate.

    ``d_k`` and ``d_v`` are free: rows (B) of Table 3 change ``d_k`` alone, so ``h * d_k`` need not
    equal ``d_model`` (§3.2.2). ``encoder_layers`` and ``decoder_layers`` set one stack's depth apart
    from ``n_layers``. ``attention``, ``feed_forward`` and ``norm`` are component specs
    ``{_target_: ..., <arguments>}`` (null: the paper's), ``positional`` a name of
    :data:`POSITIONAL_ENCODINGS` or a spec (:mod:`aiayn.model.components`). A value the model cannot use
    raises :class:`~aiayn.errors.FieldError` naming the field (``d_model=511 must be even for
    positional=sinusoidal``).
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
    positional: str | dict[str, Any] = "sinusoidal"
    norm_first: bool = False
    share_embeddings: bool = True
    max_positions: int = 1024
    pad_id: int = 0
    encoder_layers: int | None = None
    decoder_layers: int | None = None
    attention: dict[str, Any] | None = None
    feed_forward: dict[str, Any] | None = None
    norm: dict[str, Any] | None = None

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
        for key in ("encoder_layers", "decoder_layers"):
            value = getattr(self, key)
            if value is not None and not whole(value, 1):
                raise FieldError(key, value, f"must be null (n_layers={self.n_layers}) or a positive whole number")
        for key in ("norm_first", "share_embeddings"):
            if not isinstance(getattr(self, key), bool):
                raise FieldError(key, getattr(self, key), "must be true or false")
        for key in ("attention", "feed_forward", "norm"):
            value = getattr(self, key)
            if value is not None:
                setattr(self, key, spec(key, value))
        if isinstance(self.positional, Mapping):
            self.positional = spec("positional", self.positional)
        elif self.positional not in POSITIONAL_ENCODINGS:
            raise FieldError(
                "positional",
                self.positional,
                f"must be one of {', '.join(POSITIONAL_ENCODINGS)} or a spec {{_target_: ...}}",
            )
        # Sinusoids come in sine/cosine pairs, one pair per two dimensions (§3.5); rotations turn pairs of d_k.
        if self.positional_name == "sinusoidal" and self.d_model % 2:
            raise FieldError("d_model", self.d_model, "must be even for positional=sinusoidal")
        if self.positional_name == "rope" and self.d_k % 2:
            raise FieldError("d_k", self.d_k, "must be even for positional=rope")

    @property
    def encoder_depth(self) -> int:
        return self.n_layers if self.encoder_layers is None else self.encoder_layers

    @property
    def decoder_depth(self) -> int:
        return self.n_layers if self.decoder_layers is None else self.decoder_layers

    @property
    def positional_name(self) -> str | None:
        """``positional``'s name, also when a spec names a built-in without arguments; None for others."""
        if isinstance(self.positional, str):
            return self.positional
        return POSITIONAL_TARGETS.get(self.positional["_target_"]) if len(self.positional) == 1 else None

    @property
    def positional_spec(self) -> dict[str, Any]:
        """``positional`` as a spec: a name becomes the spec of its class."""
        if isinstance(self.positional, dict):
            return self.positional
        return {"_target_": target_of(POSITIONAL_NAMES[self.positional])}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
