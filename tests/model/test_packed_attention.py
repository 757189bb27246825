"""``model.packed_attention``: the teacher-forced encoder self-attention and encoder-decoder attention
run over packed sequences without padding masks (what FlashAttention-2 serves on a GPU); the loss, the
logits at real positions and every gradient equal those of the padded path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from aiayn.config.compose import compose_run_config
from aiayn.config.plan import ModuleSettings, module_settings
from aiayn.model import Packing, TransformerConfig
from aiayn.training.module import TranslationModule
from helpers.batches import BOS, EOS, ragged_batch

LENGTHS = [(9, 3), (2, 11), (6, 6), (1, 1), (9, 11)]  # (source, target): padding on both sides


def test_the_batch_says_where_each_sides_real_tokens_are() -> None:
    batch = ragged_batch(LENGTHS, 64)  # each side gets its EOS: lengths + 1
    assert batch["offsets"].tolist() == [[0, 10, 13, 20, 22, 32], [0, 4, 16, 23, 25, 37]]
    width = batch["src"].size(1)
    real = [row * width + i for row, (s, _) in enumerate(LENGTHS) for i in range(s + 1)]
    assert batch["source_rows"].tolist() == real
    assert batch["src"].flatten()[batch["source_rows"]].ne(0).all() and batch["src"].ne(0).sum() == 32


def test_the_nested_sequences_know_their_lengths_without_reading_the_offsets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU, SDPA picks its kernel for nested sequences by asking for the shortest and the longest
    (``torch.nested``'s seqlen accessors); one that must compute them reads its offsets, and the host
    waits for the device. The packings the batch gives know both, so the accessors read nothing."""
    batch = ragged_batch(LENGTHS, 64)
    target, source = Packing.of_batch(batch)
    assert (target.shortest, source.shortest) == (2, 2)  # the pair (1, 1), each side with its EOS
    reads: list[str] = []

    def counted(name: str) -> Callable[..., Any]:
        original = getattr(torch.Tensor, name)
        return lambda tensor, *args: reads.append(name) or original(tensor, *args)

    for name in ("item", "tolist", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    for packing, width in ((target, batch["tgt_in"].size(1)), (source, batch["src"].size(1))):
        nested = packing.nested(torch.zeros(len(packing.rows), 4 * 8), 4, width)
        assert (nested._get_min_seqlen(), nested._get_max_seqlen()) == (packing.shortest, width)
    assert reads == []


@pytest.mark.parametrize(("norm_first", "d_v"), [(False, 8), (True, 12)])
def test_packed_attention_gives_the_padded_loss_and_gradients(norm_first: bool, d_v: int) -> None:
    cfg = TransformerConfig(
        vocab_size=64, n_layers=2, d_model=32, d_ff=64, n_heads=4, d_k=8, d_v=d_v, dropout=0.3, norm_first=norm_first
    )
    torch.manual_seed(0)
    module = TranslationModule(model=cfg, bos_id=BOS, eos_id=EOS, packed_attention=True).train()
    batch = ragged_batch(LENGTHS, cfg.vocab_size)
    results = []
    for packed in (True, False):
        module.packed_attention = packed
        torch.manual_seed(1)  # the same dropout masks: dropout acts on the padded shapes on either path
        module.zero_grad()
        loss, _ = module.training_loss(batch)
        loss.backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in module.named_parameters()}))
    (packed_loss, packed_grads), (padded_loss, padded_grads) = results
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-6, atol=0)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, padded_grads[name], rtol=1e-5, atol=1e-6, msg=name)
        assert grad.abs().sum() > 0, name  # every weight, the attention's among them, took part

    module.eval()
    with torch.no_grad():
        logits = [module.real_target_logits(batch)[0] for module.packed_attention in (True, False)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def tiny_settings(*overrides: str) -> ModuleSettings:
    return module_settings(compose_run_config(["model=tiny", "logger=none", *overrides]))


def test_the_flag_reaches_the_module_and_not_the_models_checkpoint() -> None:
    settings = tiny_settings("model.packed_attention=true")
    assert settings.packed_attention is True and "packed_attention" not in settings.model.to_dict()
    assert settings.build().packed_attention is True
    with pytest.raises(ValueError, match=r"^model.packed_attention=true cannot apply positions inside attention"):
        tiny_settings("model.packed_attention=true", "model.positional=rope")


def test_packed_attention_refuses_what_it_cannot_do() -> None:
    cfg = TransformerConfig(vocab_size=64, n_layers=1, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8)
    module = TranslationModule(model=cfg, bos_id=BOS, eos_id=EOS)
    batch = ragged_batch(LENGTHS, cfg.vocab_size)
    target, _ = Packing.of_batch(batch)
    x = torch.zeros(len(LENGTHS), batch["tgt_in"].size(1), cfg.d_model)
    attention = module.model.decoder[0].self_attn
    with pytest.raises(ValueError, match="without a causal mask"):
        attention(x, causal=True, packed=(target, target))
    with pytest.raises(ValueError, match="a cache"):
        attention(x, cache={}, packed=(target, target))
