"""The 2020s variants each against its paper's formula, written out here independently: grouped-query
attention, GELU and gated feed-forward networks, RMSNorm, ALiBi, T5's relative buckets, Shaw's relative
keys, stacks of separate depths, and the FLOPs each adds or saves."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from aiayn.errors import FieldError
from aiayn.model import Transformer, TransformerConfig, forward_flops
from aiayn.model.attention import MultiHeadAttention
from aiayn.model.feed_forward import FeedForward, GatedFeedForward
from aiayn.model.positional import ALiBi, ShawRelativePositions, T5RelativeBias, alibi_slopes, t5_buckets

MHA = "aiayn.model.attention.MultiHeadAttention"
GATED = "aiayn.model.feed_forward.GatedFeedForward"


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scores_bias: torch.Tensor) -> torch.Tensor:
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + scores_bias
    return scores.softmax(-1) @ v


def test_grouped_query_attention_shares_each_key_value_head_among_its_group() -> None:
    torch.manual_seed(0)
    d_model, h, kv, d = 16, 4, 2, 8
    attention = MultiHeadAttention(d_model, n_heads=h, d_k=d, d_v=d, kv_heads=kv).eval()
    x = torch.randn(2, 5, d_model)
    q, k, v = attention.qkv_proj(x).split((h * d, kv * d, kv * d), dim=-1)
    q = q.unflatten(-1, (h, d)).transpose(1, 2)
    k = k.unflatten(-1, (kv, d)).transpose(1, 2)[:, [0, 0, 1, 1]]  # query heads 0, 1 read kv head 0; 2, 3 head 1
    v = v.unflatten(-1, (kv, d)).transpose(1, 2)[:, [0, 0, 1, 1]]
    expected = attention.out_proj(softmax_attention(q, k, v, torch.zeros(5, 5)).transpose(1, 2).flatten(-2))
    torch.testing.assert_close(attention(x), expected)
    cache: dict[str, torch.Tensor] = {}
    attention(x[:, :1], causal=True, cache=cache)
    assert cache["k"].shape == (2, kv, 1, d)  # the cache keeps the shared heads only


@pytest.mark.parametrize("kv_heads", [0, 3, 8])
def test_key_value_heads_must_divide_the_heads(kv_heads: int) -> None:
    with pytest.raises(FieldError, match=r"^attention.kv_heads=\d must be a whole number that divides n_heads=4$"):
        MultiHeadAttention(16, n_heads=4, d_k=4, d_v=4, kv_heads=kv_heads)


def test_the_feed_forward_variants_follow_their_formulas() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 16)
    gelu = FeedForward(16, 32, activation="gelu")
    erf_gelu = lambda h: h * 0.5 * (1 + torch.erf(h / math.sqrt(2)))  # noqa: E731 - Hendrycks and Gimpel's x Φ(x)
    torch.testing.assert_close(gelu(x), gelu.w2(erf_gelu(gelu.w1(x))))
    swiglu = GatedFeedForward(16, 48)
    w, v = swiglu.w_gate_value.weight.chunk(2, dim=0)
    swish = lambda h: h * torch.sigmoid(h)  # noqa: E731 - Swish with beta 1
    torch.testing.assert_close(swiglu(x), (swish(x @ w.T) * (x @ v.T)) @ swiglu.w2.weight.T)
    assert swiglu.w2.in_features == 32  # 2/3 of d_ff: three matrices of d_model x 32 = two of d_model x 48
    paper = FeedForward(16, 48)
    assert sum(p.numel() for p in swiglu.parameters()) == sum(p.weight.numel() for p in (paper.w1, paper.w2))


def test_rms_norm_is_x_over_its_root_mean_square_times_a_gain() -> None:
    cfg = TransformerConfig(vocab_size=20, n_layers=1, d_model=8, d_ff=16, n_heads=2, d_k=4, d_v=4,
                            norm={"_target_": "torch.nn.RMSNorm", "eps": 1e-6})  # fmt: skip
    norm = Transformer(cfg).encoder[0].ffn_block.norm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
    x = torch.randn(4, 8)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)


def test_alibi_slopes_and_biases_are_the_papers() -> None:
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # not a power of two: the 4 slopes of 4 heads, then every other slope of 8 heads (Press et al.'s code)
    torch.testing.assert_close(alibi_slopes(6), torch.tensor([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]))
    bias = ALiBi(n_heads=8).bias(torch.zeros(1, 8, 3, 4), keys=6, offset=3, causal=True)
    for head in (0, 7):
        for i in range(3):
            for j in range(6):
                assert bias[0, head, i, j].item() == -(2.0 ** -(head + 1)) * abs(3 + i - j)


def reference_t5_bucket(relative: int, bidirectional: bool, n_buckets: int, max_distance: int) -> int:
    """T5's _relative_position_bucket, one position at a time, as Raffel et al.'s mesh-tensorflow wrote it
    (n = -relative, the query position minus the key position)."""
    bucket, n = 0, -relative
    if bidirectional:
        n_buckets //= 2
        bucket += n_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    exact = n_buckets // 2
    if n < exact:
        return bucket + n
    wide = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (n_buckets - exact))
    return bucket + min(wide, n_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_equal_the_reference_at_every_distance(bidirectional: bool) -> None:
    relative = torch.arange(-300, 301)
    ours = t5_buckets(relative, bidirectional, 32, 128).tolist()
    assert ours == [reference_t5_bucket(r, bidirectional, 32, 128) for r in relative.tolist()]


def test_t5_bias_reads_each_stacks_table_by_bucket() -> None:
    t5 = T5RelativeBias(n_heads=2, n_buckets=8, max_distance=16)
    q = torch.zeros(1, 2, 4, 3)
    for causal, table in ((False, t5.encoder_table), (True, t5.decoder_table)):
        bias = t5.bias(q, keys=4, offset=0, causal=causal)
        for i in range(4):
            for j in range(4):
                bucket = reference_t5_bucket(j - i, not causal, 8, 16)
                torch.testing.assert_close(bias[0, :, i, j], table.weight[bucket])


def test_shaw_relative_keys_add_q_dot_the_clipped_distance_vector() -> None:
    torch.manual_seed(0)
    shaw = ShawRelativePositions(d_k=4, max_distance=2)
    q = torch.randn(2, 3, 5, 4)
    bias = shaw.bias(q, keys=7, offset=1, causal=True)
    table = shaw.decoder_table.weight
    for i in range(5):
        for j in range(7):
            clipped = max(-2, min(2, j - (1 + i))) + 2
            expected = q[:, :, i] @ table[clipped] / 2.0  # sqrt(d_k) = 2, as eq. 5 scales the whole score
            torch.testing.assert_close(bias[:, :, i, j], expected)


@pytest.mark.parametrize("positional", ["alibi", "t5", "shaw"])
def test_a_bias_enters_the_scores_as_eq_5_adds_it(positional: str) -> None:
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=30, n_layers=1, d_model=16, d_ff=16, n_heads=2, d_k=8, d_v=8,
                            positional=positional, dropout=0.0)  # fmt: skip
    model = Transformer(cfg).eval()
    attention, positions = model.encoder[0].self_attn, model.positions
    x = torch.randn(1, 6, 16)
    q, k, v = (part.unflatten(-1, (2, 8)).transpose(1, 2) for part in attention.qkv_proj(x).split(16, dim=-1))
    bias = positions.bias(q, 6, 0, causal=False)
    expected = attention.out_proj(softmax_attention(q, k, v, bias).transpose(1, 2).flatten(-2))
    torch.testing.assert_close(attention(x, positions=positions), expected)


def test_separate_depths_build_stacks_of_their_own() -> None:
    cfg = TransformerConfig(vocab_size=30, n_layers=6, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8,
                            encoder_layers=4, decoder_layers=1)  # fmt: skip
    model = Transformer(cfg)
    assert (len(model.encoder), len(model.decoder)) == (4, 1)
    with pytest.raises(FieldError, match=r"^decoder_layers=0 must be null \(n_layers=6\) or a positive whole number$"):
        TransformerConfig(vocab_size=30, decoder_layers=0)


VARIANTS = {
    "paper": {},
    "grouped_query": {"attention": {"_target_": MHA, "kv_heads": 2}},
    "multi_query": {"attention": {"_target_": MHA, "kv_heads": 1}},
    "gelu": {"feed_forward": {"_target_": "aiayn.model.feed_forward.FeedForward", "activation": "gelu"}},
    "swiglu": {"feed_forward": {"_target_": GATED}},
    "geglu_unmatched": {"feed_forward": {"_target_": GATED, "activation": "gelu", "match_parameters": False}},
    "rms_norm": {"norm": {"_target_": "torch.nn.RMSNorm"}, "norm_first": True},
    "alibi": {"positional": "alibi"},
    "t5": {"positional": "t5"},
    "shaw": {"positional": "shaw"},
    "depths": {"encoder_layers": 3, "decoder_layers": 1},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_flops_count_every_product_torch_counts(variant: str) -> None:
    """MFU's numerator: the analytic count of each variant equals torch's FLOP counter on a real pass."""
    cfg = TransformerConfig(vocab_size=50, n_layers=2, d_model=32, d_ff=48, n_heads=4, d_k=8, d_v=12,
                            dropout=0.0, **VARIANTS[variant])  # fmt: skip
    model = Transformer(cfg).eval()
    src, tgt = torch.randint(1, 50, (1, 9)), torch.randint(1, 50, (1, 6))
    with FlopCounterMode(display=False) as counter:
        model(src, tgt)
    assert forward_flops(cfg, 9, 6) == counter.get_total_flops()
