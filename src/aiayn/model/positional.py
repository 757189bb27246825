"""Position information: the sinusoids of §3.5, learned embeddings (Table 3 row E) and rotary (RoPE)."""

from __future__ import annotations

import math

import torch
from torch import nn


def sinusoidal_table(n_positions: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(same angle) (§3.5)."""
    position = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    angle = position * inv_freq  # (P, d_model/2)
    table = torch.empty(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sinusoids, added to the scaled embeddings; grown on demand for longer inputs."""

    def __init__(self, d_model: int, max_positions: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.register_buffer("table", sinusoidal_table(max_positions, d_model), persistent=False)

    def forward(self, length: int, offset: int = 0) -> torch.Tensor:
        if offset + length > self.table.size(0):
            self.table = sinusoidal_table(2 * (offset + length), self.d_model).to(self.table.device)
        return self.table[offset : offset + length]  # (T, d_model)


class LearnedPositionalEmbedding(nn.Module):
    """One trained vector per position (Table 3 row E); inputs longer than ``max_positions`` are an error."""

    def __init__(self, d_model: int, max_positions: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(max_positions, d_model)
        nn.init.normal_(self.embedding.weight, std=d_model**-0.5)

    def forward(self, length: int, offset: int = 0) -> torch.Tensor:
        if offset + length > self.embedding.num_embeddings:
            raise ValueError(
                f"sequence of {offset + length} positions exceeds model.max_positions={self.embedding.num_embeddings}"
            )
        positions = torch.arange(offset, offset + length, device=self.embedding.weight.device)
        return self.embedding(positions)  # (T, d_model)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021) applied to queries and keys of self-attention.

    Pairs (x[2i], x[2i+1]) of each head are rotated by the angle pos * 10000^(-2i/d_k): the same
    frequencies as §3.5, but relative positions enter the dot product instead of the input sum.
    """

    def __init__(self, d_k: int, max_positions: int) -> None:
        super().__init__()
        self.d_k = d_k
        self._build(max_positions)

    def _build(self, n_positions: int) -> None:
        angle = sinusoidal_table(n_positions, self.d_k)
        # sinusoidal_table interleaves sin/cos of the same angle; rebuild cos and sin per pair.
        self.register_buffer("sin", angle[:, 0::2].repeat_interleave(2, dim=-1), persistent=False)
        self.register_buffer("cos", angle[:, 1::2].repeat_interleave(2, dim=-1), persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
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
