"""Encoder and decoder layers (§3.1) with the residual sub-layer connection of §3.1 and §5.4."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from aiayn.model.attention import MultiHeadAttention, Packing
from aiayn.model.config import TransformerConfig
from aiayn.model.dropout import Dropout
from aiayn.model.positional import RotaryEmbedding


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (§3.3), with optional dropout on the hidden ReLU activations
    (``activation_dropout``, fairseq's name; not in the paper, whose dropout acts on sub-layer outputs)."""

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_model)
        self.activation_dropout = Dropout(activation_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.activation_dropout(torch.relu(self.w1(x))))


class SublayerConnection(nn.Module):
    """Post-LN ``LayerNorm(x + Dropout(Sublayer(x)))`` as in the paper (§3.1, §5.4), or pre-LN
    ``x + Dropout(Sublayer(LayerNorm(x)))`` when ``norm_first``."""

    def __init__(self, d_model: int, dropout: float, norm_first: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


def _attention(cfg: TransformerConfig, self_attention: bool, rotary: RotaryEmbedding | None) -> MultiHeadAttention:
    """One multi-head attention of the sizes ``cfg`` gives (rotations apply to self-attention only)."""
    return MultiHeadAttention(
        cfg.d_model,
        n_heads=cfg.n_heads,
        d_k=cfg.d_k,
        d_v=cfg.d_v,
        attn_dropout=cfg.attn_dropout,
        self_attention=self_attention,
        rotary=rotary,
    )


class EncoderLayer(nn.Module):
    """Self-attention, then the feed-forward network (§3.1)."""

    def __init__(self, cfg: TransformerConfig, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        self.self_attn = _attention(cfg, True, rotary)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout)
        self.attn_block = SublayerConnection(cfg.d_model, cfg.dropout, cfg.norm_first)
        self.ffn_block = SublayerConnection(cfg.d_model, cfg.dropout, cfg.norm_first)

    def forward(self, x: torch.Tensor, src_padding: torch.Tensor | None, source: Packing | None = None) -> torch.Tensor:
        """``source``: attend over the packed source sequences instead of under ``src_padding``."""
        packed = (source, source) if source is not None else None
        x = self.attn_block(x, lambda y: self.self_attn(y, key_padding_mask=src_padding, packed=packed))
        return self.ffn_block(x, self.ffn)


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, then the feed-forward network (§3.1)."""

    def __init__(self, cfg: TransformerConfig, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        self.self_attn = _attention(cfg, True, rotary)
        self.cross_attn = _attention(cfg, False, None)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout)
        self.self_block = SublayerConnection(cfg.d_model, cfg.dropout, cfg.norm_first)
        self.cross_block = SublayerConnection(cfg.d_model, cfg.dropout, cfg.norm_first)
        self.ffn_block = SublayerConnection(cfg.d_model, cfg.dropout, cfg.norm_first)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        src_padding: torch.Tensor | None,
        cache: dict[str, dict[str, torch.Tensor]] | None = None,
        packed: tuple[Packing, Packing] | None = None,
    ) -> torch.Tensor:
        """``cache`` (incremental decoding) holds this layer's ``"self"`` and ``"cross"`` attention caches.
        ``packed`` (the target's and the source's :class:`Packing`): encoder-decoder attention over packed
        sequences; the causal self-attention needs no mask and stays padded."""
        self_cache = cross_cache = None
        if cache is not None:
            self_cache, cross_cache = cache.setdefault("self", {}), cache.setdefault("cross", {})
        x = self.self_block(x, lambda y: self.self_attn(y, causal=True, cache=self_cache))
        x = self.cross_block(
            x, lambda y: self.cross_attn(y, memory, key_padding_mask=src_padding, cache=cross_cache, packed=packed)
        )
        return self.ffn_block(x, self.ffn)
