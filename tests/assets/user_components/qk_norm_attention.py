"""A user's own attention, written outside aiayn against its documented contract (docs/components.md):
query-key normalisation (Henry et al. 2020), softmax(g · cos(q_i, k_j)) V with a learned scale g."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class QKNormAttention(nn.Module):
    def __init__(
        self,
        d_model: int,
        *,
        n_heads: int,
        d_k: int,
        d_v: int,
        attn_dropout: float = 0.0,
        self_attention: bool = True,
        scale: float = 10.0,
    ) -> None:
        super().__init__()
        self.n_heads, self.d_k, self.d_v, self.attn_dropout = n_heads, d_k, d_v, attn_dropout
        self.self_attention = self_attention
        self.q = nn.Linear(d_model, n_heads * d_k)
        self.k = nn.Linear(d_model, n_heads * d_k)
        self.v = nn.Linear(d_model, n_heads * d_v)
        self.out = nn.Linear(n_heads * d_v, d_model)
        self.scale = nn.Parameter(torch.tensor(float(scale)))

    def heads(self, x: torch.Tensor, size: int) -> torch.Tensor:
        return x.unflatten(-1, (self.n_heads, size)).transpose(1, 2)

    def forward(self, query, memory=None, key_padding_mask=None, causal=False, cache=None, packed=None, positions=None):
        if packed is not None:
            raise ValueError("QKNormAttention does not attend over packed sequences")
        source = query if self.self_attention else memory
        q = self.heads(self.q(query), self.d_k)
        past = cache["k"].size(-2) if cache is not None and "k" in cache and self.self_attention else 0
        if cache is not None and "k" in cache and not self.self_attention:
            k, v = cache["k"], cache["v"]
        else:
            k, v = self.heads(self.k(source), self.d_k), self.heads(self.v(source), self.d_v)
            if self.self_attention and positions is not None:
                q, k = positions.rotate(q, past), positions.rotate(k, past)
            if past:
                k, v = torch.cat([cache["k"], k], dim=-2), torch.cat([cache["v"], v], dim=-2)
            if cache is not None:
                cache["k"], cache["v"] = k, v
        scores = self.scale * F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        if self.self_attention and positions is not None:
            bias = positions.bias(q, k.size(-2), past, causal)
            if bias is not None:
                scores = scores + bias
        if causal and not past:
            future = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        weights = F.dropout(scores.softmax(-1), self.attn_dropout, self.training)
        return self.out((weights @ v).transpose(1, 2).flatten(-2))
