"""The models we race: Hugging Face's MarianMTModel and a Transformer built on `torch.nn.Transformer`,
each with the dimensions, vocabulary and dropouts of one of our model configs.

Both compute what the paper's model computes (§3, §5.4): post-LN layers, ReLU feed-forward, sinusoidal
positions, embeddings scaled by sqrt(d_model) and shared with the pre-softmax projection, dropout 0.1 on
the sub-layer outputs and on the embeddings, none on attention weights or inside the feed-forward network.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from aiayn.export.marian import marian_config
from aiayn.model import TransformerConfig
from aiayn.model.positional import SinusoidalPositionalEncoding


def marian(cfg: TransformerConfig) -> nn.Module:
    """A MarianMTModel of ``cfg``'s size: it returns logits for ``(src, tgt_in)`` as ours does."""
    try:
        from transformers import MarianMTModel
    except ImportError as error:
        raise SystemExit('MarianMTModel needs transformers: pip install -e ".[bench]" (or pass --skip-hf)') from error

    model = MarianMTModel(marian_config(cfg))  # its own initialisation; ours are copied by aiayn-export only

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
            mask = src.ne(cfg.pad_id).long()
            # use_cache=False: training keeps no key/value cache for generation
            return self.model(input_ids=src, attention_mask=mask, decoder_input_ids=tgt_in, use_cache=False).logits

    return Logits()


class NNTransformer(nn.Module):
    """The model as one writes it with ``torch.nn.Transformer`` (batch first), tied embeddings added."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        if cfg.d_k * cfg.n_heads != cfg.d_model or cfg.d_v != cfg.d_k:
            raise ValueError("nn.Transformer needs d_k = d_v = d_model / n_heads")
        self.pad_id = cfg.pad_id
        self.scale = math.sqrt(cfg.d_model)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.positions = SinusoidalPositionalEncoding(cfg.d_model, cfg.max_positions)
        self.dropout = nn.Dropout(cfg.dropout)
        self.transformer = nn.Transformer(
            cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.n_layers, cfg.d_ff, cfg.dropout, batch_first=True
        )
        # nn.Transformer applies its one dropout also to attention weights and inside the feed-forward
        # network, and closes both stacks with a LayerNorm; the paper (and both other contestants) do not.
        self.transformer.encoder.norm = self.transformer.decoder.norm = None
        for layer in [*self.transformer.encoder.layers, *self.transformer.decoder.layers]:
            layer.dropout.p = 0.0
            layer.self_attn.dropout = cfg.attn_dropout
            if hasattr(layer, "multihead_attn"):
                layer.multihead_attn.dropout = cfg.attn_dropout
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.output.weight = self.embed.weight

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.embed(tokens) * self.scale + self.positions(tokens.size(1)))

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        padding = src.eq(self.pad_id)
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1))
        out = self.transformer(
            self._embed(src),
            self._embed(tgt_in),
            tgt_mask=causal,
            src_key_padding_mask=padding,
            memory_key_padding_mask=padding,
            tgt_is_causal=True,
        )
        return self.output(out)
