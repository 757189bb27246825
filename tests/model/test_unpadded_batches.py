"""A batch without padding goes through the attention with its (all-False) padding mask, since asking
whether a batch has padding would make the host wait for the device: the mask changes no value."""

from __future__ import annotations

import pytest
import torch

from aiayn.model import Transformer, TransformerConfig


@pytest.mark.parametrize("attn_dropout", [0.0, 0.1])
def test_an_all_false_padding_mask_gives_the_outputs_and_gradients_of_no_mask(attn_dropout: float) -> None:
    """Encoder and decoder, forward and backward, bit for bit (in training mode the dropout masks are
    drawn from the same seed): SDPA takes the same kernel on the CPU with and without the mask."""
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=50, n_layers=2, d_model=32, d_ff=64, n_heads=4, attn_dropout=attn_dropout)
    model = Transformer(cfg).train(attn_dropout > 0)
    src, tgt = torch.randint(4, 50, (3, 9)), torch.randint(4, 50, (3, 7))
    outputs, grads = [], []
    for mask in (src.eq(cfg.pad_id), None):
        assert mask is None or not mask.any()
        torch.manual_seed(1)
        model.zero_grad()
        x = model._embed(model.src_embed, src)
        for layer in model.encoder:
            x = layer(x, mask)
        logits = model.decode(tgt, model.encoder_norm(x), mask)
        logits.logsumexp(-1).sum().backward()
        outputs.append(logits.detach())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert torch.equal(*outputs)
    assert len(grads[0]) == len(grads[1]) > 0 and all(map(torch.equal, *grads))
    # and the model's own forward computes those values
    torch.manual_seed(1)
    assert torch.equal(model(src, tgt).detach(), outputs[0])
