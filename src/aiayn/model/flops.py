"""Parameter and FLOP counts of the Transformer, for summaries and model-FLOPs utilisation."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from aiayn.model.components import cost_class
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
        "positional": [model.positions],
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
    hardware computes them, also where the causal mask discards half), each component by its own
    ``flops`` (:func:`aiayn.model.components.cost_class`).
    """
    d, h, d_k, d_v = cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_v
    s, t = src_len, tgt_len
    attention, attention_args = cost_class("attention", cfg.attention)
    ffn, ffn_args = cost_class("feed_forward", cfg.feed_forward)
    positions, position_args = cost_class("positional", cfg.positional_spec)

    def attend(queries: int, keys: int, self_attention: bool) -> int:
        sizes = {"d_model": d, "n_heads": h, "d_k": d_k, "d_v": d_v, "queries": queries, "keys": keys}
        flops = attention.flops(**sizes, **attention_args)
        if self_attention:
            flops = flops + positions.flops(n_heads=h, d_k=d_k, queries=queries, keys=keys, **position_args)
        return flops

    def feed_forward(n: int) -> int:
        return ffn.flops(d_model=d, d_ff=cfg.d_ff, tokens=n, **ffn_args)

    encoder = cfg.encoder_depth * (attend(s, s, True) + feed_forward(s))
    decoder = cfg.decoder_depth * (attend(t, t, True) + attend(t, s, False) + feed_forward(t))
    return encoder + decoder + 2 * t * d * cfg.vocab_size


def training_flops_per_token(cfg: TransformerConfig, seq_len: int = 32) -> float:
    """Forward + backward FLOPs (3x forward) per token, source and target tokens both counted,
    for pairs of ``seq_len`` source and ``seq_len`` target tokens."""
    return 3 * forward_flops(cfg, seq_len, seq_len) / (2 * seq_len)


def batch_training_flops(cfg: TransformerConfig, src_lengths: torch.Tensor, tgt_lengths: torch.Tensor) -> float:
    """Forward + backward FLOPs (3x forward) of a batch, counting each pair at its real (unpadded)
    lengths: the model FLOPs of model-FLOPs utilisation, which padding does not add to."""
    return 3.0 * float(forward_flops(cfg, src_lengths.double(), tgt_lengths.double()).sum())
