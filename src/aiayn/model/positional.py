"""Position information (§3.5 and what followed): each kind is a :class:`PositionalEncoding` the model
asks at three points, so a new kind is a class, not a fork of the attention.

- Added to the embeddings: the sinusoids of §3.5, learned embeddings (Table 3 row E).
- Rotating queries and keys of self-attention: RoPE (Su et al. 2021).
- Biasing the self-attention scores: ALiBi (Press et al. 2022), T5's bucketed relative bias (Raffel et al.
  2020) and relative key representations (Shaw et al. 2018).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn

from aiayn.errors import FieldError, whole


class PositionalEncoding(nn.Module):
    """The contract of a positional component; the base class is "no position information" (``none``).

    The model builds one for the whole model, passing the keywords its constructor names among
    ``d_model``, ``n_heads``, ``d_k`` and ``max_positions``, then the spec's own arguments. It calls:

    - :meth:`embed` once per embedded sequence: (T, d_model) added to the scaled embeddings, or None;
    - :meth:`rotate` on the queries and keys of every self-attention, (B, h, T, d_k);
    - :meth:`bias` on every self-attention's scores: an additive (1 or B, h, T, S) before the softmax.

    ``offset`` is the position of the first of the T queries (incremental decoding feeds one at a time);
    key positions run from 0. ``causal`` is true in the decoder's self-attention, false in the
    encoder's, so a kind may keep one table per stack (T5, Shaw). Encoder-decoder attention sees no
    positions. Set :attr:`in_attention` when :meth:`rotate` or :meth:`bias` act: attention over packed
    sequences (``model.packed_attention``) cannot apply them.
    """

    in_attention: ClassVar[bool] = False

    def embed(self, length: int, offset: int = 0) -> torch.Tensor | None:
        return None

    def rotate(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return x

    def bias(self, q: torch.Tensor, keys: int, offset: int, causal: bool) -> torch.Tensor | None:
        return None

    @staticmethod
    def flops(*, n_heads: int, d_k: int, queries: int, keys: int, **args: object) -> int:
        """Multiply-add FLOPs (2 per MAC) this kind adds to one self-attention over one sequence."""
        return 0


def sinusoidal_table(n_positions: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(same angle) (§3.5)."""
    position = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    angle = position * inv_freq  # (P, d_model/2)
    table = torch.empty(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


class SinusoidalPositionalEncoding(PositionalEncoding):
    """Fixed sinusoids, added to the scaled embeddings; grown on demand for longer inputs."""

    def __init__(self, d_model: int, max_positions: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.register_buffer("table", sinusoidal_table(max_positions, d_model), persistent=False)

    def embed(self, length: int, offset: int = 0) -> torch.Tensor:
        if offset + length > self.table.size(0):
            self.table = sinusoidal_table(2 * (offset + length), self.d_model).to(self.table.device)
        return self.table[offset : offset + length]  # (T, d_model)

    forward = embed


class LearnedPositionalEmbedding(PositionalEncoding):
    """One trained vector per position (Table 3 row E); inputs longer than ``max_positions`` are an error."""

    def __init__(self, d_model: int, max_positions: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(max_positions, d_model)
        nn.init.normal_(self.embedding.weight, std=d_model**-0.5)

    def embed(self, length: int, offset: int = 0) -> torch.Tensor:
        if offset + length > self.embedding.num_embeddings:
            raise ValueError(
                f"sequence of {offset + length} positions exceeds model.max_positions={self.embedding.num_embeddings}"
            )
        positions = torch.arange(offset, offset + length, device=self.embedding.weight.device)
        return self.embedding(positions)  # (T, d_model)

    forward = embed


class RotaryEmbedding(PositionalEncoding):
    """Rotary position embedding (Su et al. 2021) applied to queries and keys of self-attention.

    Pairs (x[2i], x[2i+1]) of each head are rotated by the angle pos * 10000^(-2i/d_k): the same
    frequencies as §3.5, but relative positions enter the dot product instead of the input sum.
    """

    in_attention = True

    def __init__(self, d_k: int, max_positions: int) -> None:
        super().__init__()
        self.d_k = d_k
        self._build(max_positions)

    def _build(self, n_positions: int) -> None:
        angle = sinusoidal_table(n_positions, self.d_k)
        # sinusoidal_table interleaves sin/cos of the same angle; rebuild cos and sin per pair.
        self.register_buffer("sin", angle[:, 0::2].repeat_interleave(2, dim=-1), persistent=False)
        self.register_buffer("cos", angle[:, 1::2].repeat_interleave(2, dim=-1), persistent=False)

    def rotate(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Rotate ``x`` of shape (B, h, T, d_k) whose first position is ``offset``."""
        length = x.size(-2)
        if offset + length > self.sin.size(0):
            device = self.sin.device
            self._build(2 * (offset + length))
            self.sin, self.cos = self.sin.to(device), self.cos.to(device)
        sin = self.sin[offset : offset + length].to(x.dtype)  # (T, d_k)
        cos = self.cos[offset : offset + length].to(x.dtype)
        pairs = x.unflatten(-1, (-1, 2))  # (B, h, T, d_k/2, 2)
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)  # (-x1, x0) per pair
        return x * cos + rotated * sin

    forward = rotate


def relative_positions(queries: int, keys: int, offset: int, device: torch.device) -> torch.Tensor:
    """(T, S) of ``j - i``: key position minus query position, the queries starting at ``offset``."""
    query = torch.arange(offset, offset + queries, device=device)
    return torch.arange(keys, device=device)[None, :] - query[:, None]


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al. 2022, §3): the geometric sequence 2^(-8/n), 2^(-16/n), ... for
    n heads, n a power of two; otherwise those of the power of two below, then every other slope of the
    power of two above, as the paper's code does."""

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    below = 2 ** math.floor(math.log2(n_heads))
    slopes = geometric(below) + geometric(2 * below)[0::2][: n_heads - below]
    return torch.tensor(slopes)


class ALiBi(PositionalEncoding):
    """Attention with linear biases (Press et al. 2022): score_ij − m_h · |i − j|, no embedding, no
    parameters. The decoder's causal mask leaves j ≤ i, the paper's setting; the encoder takes the same
    distance penalty both ways."""

    in_attention = True

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def bias(self, q: torch.Tensor, keys: int, offset: int, causal: bool) -> torch.Tensor:
        distance = relative_positions(q.size(-2), keys, offset, q.device).abs()
        return -(self.slopes[:, None, None] * distance).to(q.dtype)[None]  # (1, h, T, S)


def t5_buckets(relative: torch.Tensor, bidirectional: bool, n_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucket of each relative position ``j - i`` (Raffel et al. 2020, §2.1, their released code):
    half the buckets for each direction when bidirectional; exact buckets for the nearest distances,
    then logarithmically wider ones up to ``max_distance``, beyond which all share the last."""
    bucket = torch.zeros_like(relative)
    if bidirectional:
        n_buckets //= 2
        bucket = bucket + (relative > 0).long() * n_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    exact = n_buckets // 2
    wide = (
        exact
        + (
            torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact) * (n_buckets - exact)
        ).long()
    )
    wide = wide.clamp(max=n_buckets - 1)
    return bucket + torch.where(distance < exact, distance, wide)


class T5RelativeBias(PositionalEncoding):
    """T5's relative position bias (Raffel et al. 2020): a learned scalar per head and bucket of ``j - i``,
    added to the scores; one table for the encoder (both directions), one for the decoder (the past), each
    shared by every layer of its stack, as in T5."""

    in_attention = True

    def __init__(self, n_heads: int, n_buckets: int = 32, max_distance: int = 128) -> None:
        super().__init__()
        if not whole(n_buckets, 4):
            raise FieldError("positional.n_buckets", n_buckets, "must be a whole number of at least 4")
        if not whole(max_distance, n_buckets):
            raise FieldError(
                "positional.max_distance", max_distance, f"must be a whole number of at least n_buckets={n_buckets}"
            )
        self.n_buckets, self.max_distance = n_buckets, max_distance
        self.encoder_table = nn.Embedding(n_buckets, n_heads)
        self.decoder_table = nn.Embedding(n_buckets, n_heads)

    def bias(self, q: torch.Tensor, keys: int, offset: int, causal: bool) -> torch.Tensor:
        relative = relative_positions(q.size(-2), keys, offset, q.device)
        buckets = t5_buckets(relative, not causal, self.n_buckets, self.max_distance)
        table = self.decoder_table if causal else self.encoder_table
        return table(buckets).permute(2, 0, 1)[None].to(q.dtype)  # (1, h, T, S)


class ShawRelativePositions(PositionalEncoding):
    """Relative position representations for keys (Shaw et al. 2018, eq. 4-5): score_ij gains
    q_i · a_ij / sqrt(d_k), a_ij = w_clip(j − i, k) a learned d_k-vector per clipped distance, shared by the
    heads. One table per stack, shared by its layers (the paper learns one per layer); the paper's value
    representations are left out, as its ablation found them unneeded for translation (Table 3)."""

    in_attention = True

    def __init__(self, d_k: int, max_distance: int = 16) -> None:
        super().__init__()
        if not whole(max_distance, 1):
            raise FieldError("positional.max_distance", max_distance, "must be a positive whole number")
        self.max_distance = max_distance
        self.encoder_table = nn.Embedding(2 * max_distance + 1, d_k)
        self.decoder_table = nn.Embedding(2 * max_distance + 1, d_k)
        for table in (self.encoder_table, self.decoder_table):
            nn.init.normal_(table.weight, std=d_k**-0.5)

    def bias(self, q: torch.Tensor, keys: int, offset: int, causal: bool) -> torch.Tensor:
        k = self.max_distance
        relative = relative_positions(q.size(-2), keys, offset, q.device).clamp(-k, k) + k  # (T, S)
        table = (self.decoder_table if causal else self.encoder_table).weight.to(q.dtype)  # (2k+1, d_k)
        by_distance = q @ table.T / math.sqrt(q.size(-1))  # (B, h, T, 2k+1)
        return by_distance.gather(-1, relative.expand(*q.shape[:2], -1, -1))  # (B, h, T, S)

    @staticmethod
    def flops(*, n_heads: int, d_k: int, queries: int, keys: int, max_distance: int = 16, **args: object) -> int:
        return 2 * queries * n_heads * d_k * (2 * max_distance + 1)
