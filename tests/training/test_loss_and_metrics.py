"""Label-smoothed loss, initialisation and the BLEU definition."""

from __future__ import annotations

import math

import pytest
import sacrebleu
import torch
import torch.nn.functional as F
from torchmetrics.text import SacreBLEUScore

from aiayn.data.tokenizer import BOS_ID, EOS_ID
from aiayn.model import Transformer, TransformerConfig
from aiayn.scoring import BLEU_SETTINGS
from aiayn.training.loss import label_smoothed_cross_entropy
from aiayn.training.module import TranslationModule
from aiayn.training.schedule import OptimSettings

MODEL = {"vocab_size": 8000, "n_layers": 2, "d_model": 64, "d_ff": 128, "n_heads": 4, "d_k": 16, "d_v": 16}


def test_label_smoothed_loss_ignores_padding_and_matches_the_definition() -> None:
    module = TranslationModule(
        model=TransformerConfig(**MODEL), bos_id=BOS_ID, eos_id=EOS_ID, optim=OptimSettings(label_smoothing=0.1)
    )
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 8000)
    target = torch.tensor([[5, 6, 0], [7, 0, 0]])  # 0 is padding
    loss, n_tokens = module.loss(logits, target, 0.1)
    assert n_tokens == 3
    log_p = logits.log_softmax(-1)
    expected = 0.0
    for b, t in ((0, 0), (0, 1), (1, 0)):
        expected += -(0.9 * log_p[b, t, target[b, t]] + 0.1 * log_p[b, t].mean())
    assert loss.item() == pytest.approx(expected.item() / 3, rel=1e-5)
    changed = logits.clone()
    changed[0, 2] += 100 * torch.randn(8000)  # padding positions do not count
    changed[1, 1:] += 100 * torch.randn(2, 8000)
    assert module.loss(changed, target, 0.1)[0].item() == pytest.approx(loss.item(), rel=1e-6)


@pytest.mark.parametrize("norm_first", [False, True])
def test_tied_logits_start_near_uniform(norm_first: bool) -> None:
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(**MODEL, norm_first=norm_first))
    src = torch.randint(4, 8000, (8, 12))
    tgt_in, tgt_out = torch.randint(4, 8000, (8, 10)), torch.randint(4, 8000, (8, 10))
    loss = F.cross_entropy(model(src, tgt_in).flatten(0, 1), tgt_out.flatten())
    assert abs(loss.item() - math.log(8000)) / math.log(8000) < 0.1


def test_torchmetrics_bleu_equals_sacrebleu_on_real_text() -> None:
    refs = [
        "Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt.",
        "Ein Boston Terrier läuft über saftig-grünes Gras vor einem weißen Zaun.",
        "Ein Mädchen in einem Karateanzug bricht einen Stock mit einem Tritt.",
        "Fünf Leute in Winterjacken und mit Helmen stehen im Schnee mit Schneemobilen im Hintergrund.",
    ]
    hyps = [
        "Ein Mann mit einem orangen Hut starrt etwas an.",
        "Ein Boston Terrier rennt über grünes Gras vor einem weißen Zaun.",
        "Ein Mädchen im Karateanzug zerbricht einen Stock mit einem Tritt.",
        "Fünf Menschen in Winterjacken und Helmen stehen im Schnee, im Hintergrund Schneemobile.",
    ]
    metric = SacreBLEUScore(**BLEU_SETTINGS)
    metric.update(hyps[:2], [[r] for r in refs[:2]])
    metric.update(hyps[2:], [[r] for r in refs[2:]])
    expected = sacrebleu.corpus_bleu(hyps, [refs]).score
    assert 100 * metric.compute().item() == pytest.approx(expected, abs=1e-3)
    assert 10 < expected < 90


@pytest.mark.parametrize(("smoothing", "ignore_index"), [(0.1, 0), (0.0, 0), (0.3, -100)])
def test_label_smoothed_loss_and_gradient_equal_torch_cross_entropy(smoothing: float, ignore_index: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 9, 50, dtype=torch.float64, requires_grad=True)
    target = torch.randint(1, 50, (6, 9))
    target[:, -3:] = ignore_index
    expected = F.cross_entropy(
        logits.flatten(0, 1), target.flatten(), ignore_index=ignore_index, label_smoothing=smoothing, reduction="sum"
    )
    (expected_grad,) = torch.autograd.grad(expected / 7, logits)
    total = label_smoothed_cross_entropy(logits, target, smoothing, ignore_index)
    (grad,) = torch.autograd.grad(total / 7, logits)
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert grad[:, -3:].abs().max() == 0  # ignored positions get no gradient


def test_label_smoothed_loss_upcasts_bfloat16_logits() -> None:
    logits = torch.randn(4, 30).to(torch.bfloat16)
    target = torch.randint(0, 30, (4,))
    total = label_smoothed_cross_entropy(logits, target, 0.1, -100)
    assert total.dtype == torch.float32
    expected = F.cross_entropy(logits.float(), target, label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(total, expected)


def test_label_smoothed_loss_of_an_all_padding_batch_is_zero_with_zero_gradient() -> None:
    logits = torch.randn(2, 5, 30, requires_grad=True)
    total = label_smoothed_cross_entropy(logits, torch.zeros(2, 5, dtype=torch.long), 0.1, 0)
    total.backward()
    assert total.item() == 0.0
    assert logits.grad.abs().max().item() == 0.0


def test_label_smoothed_loss_gradient_reaches_bfloat16_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 30).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, 30, (8,))
    label_smoothed_cross_entropy(logits, target, 0.1, -100).backward()
    reference = logits.detach().float().requires_grad_()
    F.cross_entropy(reference, target, label_smoothing=0.1, reduction="sum").backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), reference.grad, atol=1e-2, rtol=1e-2)
