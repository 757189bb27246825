"""Parameter and FLOP counts of the Transformer, for summaries and model-FLOPs utilisation."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from aiayn.model.config import TransformerConfig

if TYPE_CHECKING:
    from aiayn.model.transformer import Transformer


def count_parameters(module: nn.Module) -> int:
    """Distinct trainable parameters (a tied matrix counts once)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def parameters_by_component(model: Transformer) -> dict[str, int]:
    """Parameters of the embeddings (with the output projection, which §3.4 ties to them), the position
    table, the encoder and the decoder: each distinct parameter counted once, under the first component
    that holds it. A model built on the meta device counts alike, without the memory."""
    components: dict[str, list[nn.Module]] = {
        "embeddings": [model.src_embed, model.tgt_embed, model.output_proj],
        "positional": [model.positions] if model.positions is not None else [],
        "encoder": [model.encoder, model.encoder_norm],
        "decoder": [model.decoder, model.decoder_norm],
    }
    seen: set[int] = set()
    counts = {}
    for name, modules in components.items():
        total = 0
        for module in modules:
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    total += param.numel()
        counts[name] = total
    return counts


def forward_flops(
    cfg: TransformerConfig, src_len: int | torch.Tensor, tgt_len: int | torch.Tensor
) -> int | torch.Tensor:
    """Multiply-add FLOPs (2 per MAC) of one forward pass over a sentence pair (or element-wise over
    tensors of lengths).

    Counts every matrix product, including attention scores over all key positions (as the
    hardware computes them, also where the causal mask discards half).
    """
    d, h, d_k, d_v, d_ff = cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_v, cfg.d_ff
    s, t = src_len, tgt_len

    def self_attention(n: int) -> int:
        projections = 2 * n * d * h * (2 * d_k + d_v) + 2 * n * h * d_v * d
        return projections + 2 * n * n * h * (d_k + d_v)

    def ffn(n: int) -> int:
        return 4 * n * d * d_ff

    encoder = cfg.n_layers * (self_attention(s) + ffn(s))
    cross = 2 * t * d * h * d_k + 2 * s * d * h * (d_k + d_v) + 2 * t * s * h * (d_k + d_v) + 2 * t * h * d_v * d
    decoder = cfg.n_layers * (self_attention(t) + cross + ffn(t))
    return encoder + decoder + 2 * t * d * cfg.vocab_size


def training_flops_per_token(cfg: TransformerConfig, seq_len: int = 32) -> float:
    """Forward + backward FLOPs (3x forward) per token, source and target tokens both counted,
    for pairs of ``seq_len`` source and ``seq_len`` target tokens."""
    return 3 * forward_flops(cfg, seq_len, seq_len) / (2 * seq_len)


def batch_training_flops(cfg: TransformerConfig, src_lengths: torch.Tensor, tgt_lengths: torch.Tensor) -> float:
    """Forward + backward FLOPs (3x forward) of a batch, counting each pair at its real (unpadded)
    lengths: the model FLOPs of model-FLOPs utilisation, which padding does not add to."""
    return 3.0 * float(forward_flops(cfg, src_lengths.double(), tgt_lengths.double()).sum())
