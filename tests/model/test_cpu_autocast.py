"""bf16 autocast on the CPU: the matrix products run in bf16, attention in fp32 (the CPU's bf16
flash-attention backward is the slow part of a bf16 step), and the model computes what it computes in
fp32 up to bf16's rounding."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from aiayn.model import Transformer, TransformerConfig

PAD = 0


def make_model() -> Transformer:
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=50, n_layers=2, d_model=64, d_ff=128, n_heads=4, d_k=16, d_v=16, dropout=0.0)
    return Transformer(cfg).train()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    src, tgt = torch.randint(4, 50, (3, 11)), torch.randint(4, 50, (3, 9))
    src[0, 7:], tgt[1, 5:] = PAD, PAD  # padding masks on both sides
    return src, tgt


def loss_and_grads(model: Transformer, autocast: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    src, tgt = batch()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        logits = model(src, tgt)
    loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), ignore_index=PAD)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_under_cpu_autocast_attention_runs_in_fp32_and_the_projections_in_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[Any, ...]] = []
    attend = F.scaled_dot_product_attention

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
        calls.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
        return attend(q, k, v, **options)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    model = make_model()
    src, tgt = batch()
    with torch.autocast("cpu", torch.bfloat16):
        logits = model(src, tgt)
    assert logits.dtype == torch.bfloat16  # the output projection ran in bf16
    # encoder self, decoder self and encoder-decoder attention of 2 layers each
    assert calls == [(torch.float32, torch.float32, torch.float32, False)] * 6


def test_bf16_autocast_trains_the_same_model_up_to_bf16_rounding() -> None:
    model = make_model()
    loss32, grads32 = loss_and_grads(model, autocast=False)
    loss16, grads16 = loss_and_grads(model, autocast=True)
    assert loss16 != loss32  # the products did run in bf16
    torch.testing.assert_close(loss16, loss32, rtol=2e-2, atol=0)
    for ours, reference in zip(grads16, grads32, strict=True):
        assert ours.dtype == torch.float32  # fp32 weights, as autocast keeps them
        assert F.cosine_similarity(ours.flatten(), reference.flatten(), dim=0) > 0.99
