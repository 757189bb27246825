"""The decoder's key/value caches and greedy decoding through them."""

from __future__ import annotations

import pytest
import torch

from aiayn.model import Transformer, TransformerConfig, greedy_decode
from helpers.reference_search import BOS, EOS, recomputing_greedy


@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "none", "rope"])
def test_cached_decoding_equals_recomputing_the_prefix(positional: str) -> None:
    torch.manual_seed(1)
    cfg = TransformerConfig(
        vocab_size=30, n_layers=2, d_model=32, d_ff=64, n_heads=2, d_k=8, d_v=12, positional=positional
    )
    model = Transformer(cfg).eval()
    src = torch.randint(4, 30, (5, 9))
    src[1, 4:] = 0
    src[3, 6:] = 0
    with torch.no_grad():
        memory, padding = model.encode(src)
        tgt = torch.randint(4, 30, (5, 7))
        full = model.decode(tgt, memory, padding)
        state = model.init_state()
        steps = torch.cat([model.decode(tgt[:, i : i + 1], memory, padding, state) for i in range(7)], dim=1)
        torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-5)
        assert greedy_decode(model, src, BOS, EOS, max_len_offset=4) == recomputing_greedy(model, src, 4)


def test_output_length_is_bounded_by_source_length_plus_offset() -> None:
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(vocab_size=30, n_layers=1, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8))
    with torch.no_grad():
        # EOS's logit is 0 while 29 others are large and random: EOS never wins, so only the limit stops
        model.output_proj.weight.mul_(10)
        model.output_proj.weight[EOS].zero_()
    src = torch.randint(4, 30, (3, 6))
    src[2, 2:] = 0
    hyps = greedy_decode(model.eval(), src, BOS, EOS, max_len_offset=3)
    assert [len(h) for h in hyps] == [9, 9, 5]
