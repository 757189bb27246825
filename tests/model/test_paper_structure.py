"""The model is wired as §3 says: post-LN sub-layers, scaled embeddings, dropout sites (§5.4)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.model import Transformer, TransformerConfig
from aiayn.model.dropout import Dropout
from aiayn.model.positional import sinusoidal_table


def model(**overrides: object) -> Transformer:
    torch.manual_seed(0)
    cfg = {"vocab_size": 50, "n_layers": 2, "d_model": 16, "d_ff": 32, "n_heads": 2, "d_k": 8, "d_v": 8}
    return Transformer(TransformerConfig(**{**cfg, **overrides})).eval()


def test_post_ln_is_the_default_and_each_sublayer_is_layernorm_of_the_residual_sum() -> None:
    m = model()
    assert m.cfg.norm_first is False
    layer = m.encoder[0]
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        y = layer.attn_block.norm(x + layer.self_attn(x))  # LayerNorm(x + Sublayer(x)) (§3.1)
        expected = layer.ffn_block.norm(y + layer.ffn.w2(F.relu(layer.ffn.w1(y))))
        torch.testing.assert_close(layer(x, None), expected)


def test_pre_ln_normalises_the_sublayer_input_instead() -> None:
    m = model(norm_first=True)
    layer = m.encoder[0]
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        y = x + layer.self_attn(layer.attn_block.norm(x))
        expected = y + layer.ffn(layer.ffn_block.norm(y))
        torch.testing.assert_close(layer(x, None), expected)
    assert isinstance(m.encoder_norm, nn.LayerNorm) and isinstance(model().encoder_norm, nn.Identity)


def test_embeddings_are_scaled_by_sqrt_d_model_and_summed_with_the_sinusoids() -> None:
    m = model()
    tokens = torch.tensor([[5, 6, 7]])
    expected = m.src_embed.weight[tokens] * math.sqrt(16) + sinusoidal_table(3, 16)
    torch.testing.assert_close(m._embed(m.src_embed, tokens), expected)
    assert torch.equal(model(positional="none")._embed(m.src_embed, tokens), m.src_embed.weight[tokens] * 4.0)


def test_dropout_sits_on_sublayer_outputs_and_embedding_sums_only() -> None:
    m = model(dropout=0.3)
    rates = {name: module.p for name, module in m.named_modules() if isinstance(module, Dropout)}
    inside_ffn = {name: rates.pop(name) for name in list(rates) if name.endswith("ffn.activation_dropout")}
    assert len(inside_ffn) == 2 + 2 and set(inside_ffn.values()) == {0.0}  # not the paper's: off by default
    assert set(rates.values()) == {0.3}
    assert "embed_dropout" in rates
    # two sub-layers per encoder layer, three per decoder layer (§5.4 residual dropout)
    assert sum(".dropout" in name for name in rates) == 2 * 2 + 2 * 3
    assert all(module.attn_dropout == 0.0 for module in m.modules() if hasattr(module, "attn_dropout"))
