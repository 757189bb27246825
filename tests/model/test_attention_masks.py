"""Causality and padding invariance of the model (§3.2.3)."""

from __future__ import annotations

import pytest
import torch

from aiayn.model import MultiHeadAttention, Transformer, TransformerConfig
from aiayn.model.attention import attention_weights

PAD = 0


def make_model(positional: str, norm_first: bool) -> Transformer:
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=40,
        n_layers=2,
        d_model=32,
        d_ff=48,
        n_heads=4,
        d_k=6,
        d_v=10,
        positional=positional,
        norm_first=norm_first,
    )
    return Transformer(cfg).eval()


VARIANTS = [(p, nf) for p in ("sinusoidal", "learned", "none", "rope") for nf in (False, True)]


@pytest.mark.parametrize(("positional", "norm_first"), VARIANTS)
def test_decoder_outputs_do_not_depend_on_later_target_tokens(positional: str, norm_first: bool) -> None:
    model = make_model(positional, norm_first)
    src = torch.randint(4, 40, (3, 9))
    tgt = torch.randint(4, 40, (3, 8))
    t = 4
    changed = tgt.clone()
    changed[:, t + 1 :] = torch.randint(4, 40, (3, 8 - t - 1))
    assert not torch.equal(changed, tgt)
    with torch.no_grad():
        before, after = model(src, tgt), model(src, changed)
    torch.testing.assert_close(before[:, : t + 1], after[:, : t + 1], rtol=0, atol=1e-5)
    assert (before[:, t + 1 :] - after[:, t + 1 :]).abs().max() > 1e-3  # later positions do change


@pytest.mark.parametrize(("positional", "norm_first"), VARIANTS)
def test_padding_leaves_real_positions_unchanged(positional: str, norm_first: bool) -> None:
    model = make_model(positional, norm_first)
    src = torch.randint(4, 40, (2, 7))
    tgt = torch.randint(4, 40, (2, 5))
    padded_src = torch.cat([src, torch.full((2, 6), PAD)], dim=1)
    padded_tgt = torch.cat([tgt, torch.full((2, 3), PAD)], dim=1)
    with torch.no_grad():
        plain = model(src, tgt)
        padded = model(padded_src, padded_tgt)
    torch.testing.assert_close(padded[:, :5], plain, rtol=0, atol=1e-5)


def test_padding_of_one_sentence_does_not_change_another() -> None:
    """A short source padded inside a batch gives the same outputs as when it is alone."""
    model = make_model("sinusoidal", False)
    short = torch.randint(4, 40, (1, 4))
    long = torch.randint(4, 40, (1, 9))
    tgt = torch.randint(4, 40, (2, 6))
    batch = torch.cat([torch.cat([short, torch.full((1, 5), PAD)], dim=1), long])
    with torch.no_grad():
        together = model(batch, tgt)
        alone = model(short, tgt[:1])
    torch.testing.assert_close(together[:1], alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_recomputed_attention_weights_are_the_ones_sdpa_applies(causal: bool) -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 4)
    allowed = None if causal else torch.tensor([[True] * 5, [True, True, True, False, False]])[:, None, None, :]
    weights = attention_weights(q, k, allowed, causal)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=causal)
    torch.testing.assert_close(weights @ v, expected)


def test_attention_maps_cover_every_layer_and_head_and_respect_the_masks() -> None:
    model = make_model("sinusoidal", False).train()
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, PAD, PAD]])
    tgt_in = torch.tensor([[2, 11, 12, 13], [2, 14, PAD, PAD]])
    maps = model.attention_maps(src, tgt_in)
    assert model.training  # the mode it was in comes back
    assert all(m.recorded is None for m in model.modules() if isinstance(m, MultiHeadAttention))
    assert maps["encoder_self"].shape == (2, 2, 4, 5, 5)  # layers, batch, heads, queries, keys
    assert maps["decoder_self"].shape == (2, 2, 4, 4, 4)
    assert maps["cross"].shape == (2, 2, 4, 4, 5)
    for weights in maps.values():
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    assert maps["decoder_self"].triu(diagonal=1).abs().max() == 0  # nothing from later positions
    assert maps["encoder_self"][:, 1, :, :, 3:].abs().max() == 0  # nor from source padding
    assert maps["cross"][:, 1, :, :, 3:].abs().max() == 0
