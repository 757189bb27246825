"""The CPU dropout keeps nn.Dropout's contract: rate p, unbiased scaling, the mask reused by backward."""

from __future__ import annotations

import math

import pytest
import torch

from aiayn.model.dropout import Dropout, quantized_rate
from aiayn.model.feed_forward import FeedForward


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_every_element_is_dropped_at_rate_p_and_the_rest_scaled(p: float) -> None:
    torch.manual_seed(0)
    n = 1 << 20
    out = Dropout(p).train()(torch.ones(n))
    dropped = out.eq(0)
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(dropped.float().mean().item() - p) < 5 * sigma
    # each of the four 16-bit lanes of a 64-bit draw is dropped at the same rate (no biased bit)
    for lane in range(4):
        assert abs(dropped[lane::4].float().mean().item() - p) < 5 * 2 * sigma
    kept = out[~dropped]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - quantized_rate(p))))
    assert abs(out.mean().item() - 1.0) < 5 * sigma / (1 - p)  # expected output = input


def test_backward_uses_the_forward_mask() -> None:
    torch.manual_seed(1)
    x = torch.randn(64, 33, requires_grad=True)
    out = Dropout(0.25).train()(x)
    out.backward(torch.ones_like(out))
    scale = 1 / (1 - quantized_rate(0.25))
    expected = torch.where(out.ne(0), scale, 0.0)
    torch.testing.assert_close(x.grad, expected)


def test_masks_follow_the_seed_and_change_between_calls() -> None:
    layer = Dropout(0.1).train()
    x = torch.ones(4096)
    torch.manual_seed(7)
    first, second = layer(x), layer(x)
    torch.manual_seed(7)
    assert torch.equal(layer(x), first)
    assert not torch.equal(first, second)


def test_eval_mode_and_rate_zero_return_the_input() -> None:
    x = torch.randn(10)
    assert Dropout(0.5).eval()(x) is x
    assert Dropout(0.0).train()(x) is x


def test_rate_is_quantized_to_two_to_the_minus_16_and_never_reaches_one() -> None:
    assert abs(quantized_rate(0.1) - 0.1) <= 2**-17
    assert quantized_rate(1 - 1e-9) < 1.0
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        Dropout(1.0)


def test_activation_dropout_drops_hidden_units_of_the_feed_forward_only_while_training() -> None:
    torch.manual_seed(0)
    ffn = FeedForward(d_model=8, d_ff=4096, activation_dropout=0.25)
    with torch.no_grad():  # every hidden unit 1.0 after the ReLU; W2 sums them
        ffn.w1.weight.zero_(), ffn.w1.bias.fill_(1.0), ffn.w2.weight.fill_(1.0), ffn.w2.bias.zero_()
    seen: list[torch.Tensor] = []
    ffn.w2.register_forward_pre_hook(lambda _module, args: seen.append(args[0]))
    out = ffn(torch.randn(16, 8))
    hidden = seen[-1]
    assert (hidden == 0).float().mean().item() == pytest.approx(0.25, abs=0.01)
    assert hidden.unique().tolist() == [0.0, pytest.approx(1 / (1 - quantized_rate(0.25)))]
    assert out.mean().item() == pytest.approx(4096, rel=0.01)  # the expected sum is kept
    ffn.eval()
    assert torch.equal(ffn(torch.randn(2, 8)), torch.full((2, 8), 4096.0))
