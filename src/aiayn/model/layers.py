"""Encoder and decoder layers (§3.1) with the residual sub-layer connection of §3.1 and §5.4, built from
the components a :class:`~aiayn.model.config.TransformerConfig` names (:mod:`aiayn.model.components`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from aiayn.model.attention import Packing
from aiayn.model.components import build
from aiayn.model.config import TransformerConfig
from aiayn.model.dropout import Dropout
from aiayn.model.positional import PositionalEncoding


class SublayerConnection(nn.Module):
    """Post-LN ``Norm(x + Dropout(Sublayer(x)))`` as in the paper (§3.1, §5.4), or pre-LN
    ``x + Dropout(Sublayer(Norm(x)))`` when ``norm_first``; ``norm`` is the model's normalisation
    (LayerNorm unless a spec names another)."""

    def __init__(self, d_model: int, dropout: float, norm_first: bool, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.norm = norm if norm is not None else nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


def attention(cfg: TransformerConfig, self_attention: bool) -> nn.Module:
    """One attention of the kind and sizes ``cfg`` gives."""
    return build(
        "attention",
        cfg.attention,
        cfg.d_model,
        n_heads=cfg.n_heads,
        d_k=cfg.d_k,
        d_v=cfg.d_v,
        attn_dropout=cfg.attn_dropout,
        self_attention=self_attention,
    )


def feed_forward(cfg: TransformerConfig) -> nn.Module:
    """The position-wise network of the kind ``cfg`` gives (§3.3)."""
    return build("feed_forward", cfg.feed_forward, cfg.d_model, cfg.d_ff, activation_dropout=cfg.activation_dropout)


def norm(cfg: TransformerConfig) -> nn.Module:
    """One normalisation of the kind ``cfg`` gives."""
    return build("norm", cfg.norm, cfg.d_model)


def sublayer(cfg: TransformerConfig) -> SublayerConnection:
    return SublayerConnection(cfg.d_model, cfg.dropout, cfg.norm_first, norm(cfg))


class EncoderLayer(nn.Module):
    """Self-attention, then the feed-forward network (§3.1)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = attention(cfg, True)
        self.ffn = feed_forward(cfg)
        self.attn_block = sublayer(cfg)
        self.ffn_block = sublayer(cfg)

    def forward(
        self,
        x: torch.Tensor,
        src_padding: torch.Tensor | None,
        source: Packing | None = None,
        positions: PositionalEncoding | None = None,
    ) -> torch.Tensor:
        """``source``: attend over the packed source sequences instead of under ``src_padding``."""
        packed = (source, source) if source is not None else None
        x = self.attn_block(
            x, lambda y: self.self_attn(y, key_padding_mask=src_padding, packed=packed, positions=positions)
        )
        return self.ffn_block(x, self.ffn)


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, then the feed-forward network (§3.1)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = attention(cfg, True)
        self.cross_attn = attention(cfg, False)
        self.ffn = feed_forward(cfg)
        self.self_block = sublayer(cfg)
        self.cross_block = sublayer(cfg)
        self.ffn_block = sublayer(cfg)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        src_padding: torch.Tensor | None,
        cache: dict[str, dict[str, torch.Tensor]] | None = None,
        packed: tuple[Packing, Packing] | None = None,
        positions: PositionalEncoding | None = None,
    ) -> torch.Tensor:
        """``cache`` (incremental decoding) holds this layer's ``"self"`` and ``"cross"`` attention caches.
        ``packed`` (the target's and the source's :class:`Packing`): encoder-decoder attention over packed
        sequences; the causal self-attention needs no mask and stays padded. ``positions``: the model's
        positional encoding, for the self-attention (encoder-decoder attention sees none)."""
        self_cache = cross_cache = None
        if cache is not None:
            self_cache, cross_cache = cache.setdefault("self", {}), cache.setdefault("cross", {})
        x = self.self_block(x, lambda y: self.self_attn(y, causal=True, cache=self_cache, positions=positions))
        x = self.cross_block(
            x, lambda y: self.cross_attn(y, memory, key_padding_mask=src_padding, cache=cross_cache, packed=packed)
        )
        return self.ffn_block(x, self.ffn)
