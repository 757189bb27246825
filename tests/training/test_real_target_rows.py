"""Training projects and scores the real target positions only: the loss and every gradient equal
those of the padded batch, where the padding positions are projected and then ignored."""

from __future__ import annotations

import pytest
import torch

from aiayn.model import TransformerConfig
from aiayn.training.loss import label_smoothed_cross_entropy
from aiayn.training.module import TranslationModule
from aiayn.training.schedule import OptimSettings
from helpers.batches import BOS, EOS, PAD, ragged_batch


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_loss_and_gradients_on_real_rows_equal_the_padded_batch(dropout: float) -> None:
    cfg = TransformerConfig(vocab_size=64, n_layers=2, d_model=32, d_ff=64, n_heads=4, d_k=8, d_v=8, dropout=dropout)
    torch.manual_seed(0)
    module = TranslationModule(model=cfg, bos_id=BOS, eos_id=EOS, optim=OptimSettings(label_smoothing=0.1)).train()
    batch = ragged_batch([(9, 3), (2, 11), (6, 6), (1, 1)], cfg.vocab_size)
    n_tokens = int(batch["lengths"][:, 1].sum())
    assert batch["target_rows"].numel() == n_tokens < batch["tgt_out"].numel()  # there is padding to skip

    results = []
    for real_rows_only in (True, False):
        torch.manual_seed(1)  # the same dropout masks: the decoder runs on the same padded shapes
        module.zero_grad()
        if real_rows_only:
            loss, counted = module.training_loss(batch)
            assert counted == n_tokens
        else:
            logits = module.model(batch["src"], batch["tgt_in"])  # (B, T, vocab), padding included
            loss = label_smoothed_cross_entropy(logits, batch["tgt_out"], 0.1, PAD) / n_tokens
        loss.backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in module.named_parameters()}))
    (rows_loss, rows_grads), (padded_loss, padded_grads) = results
    torch.testing.assert_close(rows_loss, padded_loss, rtol=1e-6, atol=0)
    assert rows_grads.keys() == padded_grads.keys()
    for name, grad in rows_grads.items():
        torch.testing.assert_close(grad, padded_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert rows_grads["model.src_embed.weight"].abs().sum() > 0  # the tied projection's gradient is checked


def test_validation_counts_only_real_target_tokens() -> None:
    """The loss the validation logs per token: the same rows, the nll without smoothing."""
    cfg = TransformerConfig(vocab_size=64, n_layers=1, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8)
    torch.manual_seed(0)
    module = TranslationModule(model=cfg, bos_id=BOS, eos_id=EOS).eval()
    batch = ragged_batch([(4, 7), (5, 2)], cfg.vocab_size)
    with torch.no_grad():
        logits, target = module.real_target_logits(batch)
        full = module.model(batch["src"], batch["tgt_in"])
    keep = batch["tgt_out"].ne(PAD)
    n = int(keep.sum())  # the real rows come first; the rest pad the projection's rows (projected_rows)
    assert target[:n].tolist() == batch["tgt_out"][keep].tolist() and set(target[n:].tolist()) <= {PAD}
    torch.testing.assert_close(logits[:n], full[keep], rtol=1e-5, atol=1e-6)
