"""Causality and padding invariance of the model (§3.2.3)."""

from __future__ import annotations

import pytest
import torch

from aiayn.model import Transformer, TransformerConfig

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
