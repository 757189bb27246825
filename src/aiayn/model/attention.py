"""Multi-head scaled dot-product attention (§3.2)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.errors import FieldError, whole
from aiayn.model.positional import PositionalEncoding

# SDPA's kernels by the names the settings give them, as torch switches each on or off process-wide.
SDPA_BACKENDS = {
    "flash": torch.backends.cuda.enable_flash_sdp,
    "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
    "cudnn": torch.backends.cuda.enable_cudnn_sdp,
    "math": torch.backends.cuda.enable_math_sdp,
}
# Not cuDNN: it builds an execution graph per exact (batch, heads, lengths), tens to hundreds of ms each,
# and token-budget batches and beam search (a key length per step) bring new shapes all along.
# FlashAttention serves the causal decoder self-attention, memory-efficient attention the padding masks.
DEFAULT_SDPA_BACKENDS = ("flash", "efficient", "math")


def sdpa_backends(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` as a tuple, checked: one or more of :data:`SDPA_BACKENDS`."""
    if isinstance(names, str) or not isinstance(names, Sequence) or not names or set(names) - set(SDPA_BACKENDS):
        raise FieldError("sdpa_backends", names, f"must be a list of one or more of {', '.join(SDPA_BACKENDS)}")
    return tuple(names)


def use_sdpa_backends(names: Sequence[str] = DEFAULT_SDPA_BACKENDS) -> None:
    """Let ``F.scaled_dot_product_attention`` choose among the kernels ``names`` lists only, in this
    process, for every attention that follows (the backward takes the forward's kernel). A process-wide
    switch rather than ``torch.nn.attention.sdpa_kernel`` around each call, which costs host time at
    every one of a step's attentions."""
    chosen = sdpa_backends(names)
    for name, enable in SDPA_BACKENDS.items():
        enable(name in chosen)


@dataclass(frozen=True)
class Packing:
    """Where the real positions of a right-padded batch (B, T) are: ``rows`` (N,), their indices among the
    B * T flattened positions, in order, ``offsets`` (B + 1,), where each sequence starts among the N, and
    ``shortest``, the fewest real positions of any sequence.

    Attention over the packed sequences needs no padding mask: it is what FlashAttention-2's
    variable-length kernel serves on a GPU, where a dense mask sends SDPA to a slower kernel. The
    collator finds all three on the host, so nothing waits for the device to count tokens: a nested
    tensor not told its shortest sequence reads it from its offsets, and on a GPU the host waits for that.
    """

    rows: torch.Tensor
    offsets: torch.Tensor
    shortest: int

    @classmethod
    def of_batch(cls, batch: dict[str, Any]) -> tuple[Packing, Packing]:
        """The target's and the source's packing of a batch as :class:`aiayn.data.dataset.Collator` makes it."""
        shortest = batch["lengths"].min(0)  # NumPy: on the host
        offsets = batch["offsets"]
        return (
            cls(batch["target_rows"], offsets[1], int(shortest[1])),
            cls(batch["source_rows"], offsets[0], int(shortest[0])),
        )

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) → the real positions' (N, ...)."""
        return x.flatten(0, 1).index_select(0, self.rows)

    def nested(self, values: torch.Tensor, heads: int, width: int) -> torch.Tensor:
        """Packed (N, heads * d) → a nested tensor (B, heads, j, d) of B sequences of their own lengths;
        ``width``, the padded length, bounds them (a shape: the kernel's grid needs no count)."""
        # Each of Q, K, V is a view into the fused projection; the nested kernels want them whole.
        per_head = values.unflatten(-1, (heads, -1)).contiguous()
        nested = torch.nested.nested_tensor_from_jagged(
            per_head, self.offsets, min_seqlen=self.shortest, max_seqlen=width
        )
        return nested.transpose(1, 2)

    def unpack(self, values: torch.Tensor, batch: int, width: int) -> torch.Tensor:
        """Packed (N, d) → (B, width, d), zero at the padding positions."""
        padded = values.new_zeros(batch * width, values.size(-1)).index_copy(0, self.rows, values)
        return padded.unflatten(0, (batch, width))


class MultiHeadAttention(nn.Module):
    """``Concat(head_1..head_h) W^O`` with ``head_i = softmax(Q W_i^Q (K W_i^K)^T / sqrt(d_k)) V W_i^V`` (§3.2.2).

    ``d_k`` and ``d_v`` are independent of ``d_model / n_heads`` (Table 3 rows A, B). Self-attention
    projects Q, K and V with one fused matrix; encoder-decoder attention projects the decoder states to
    Q and the encoder output to K, V (§3.2.3), so those projections are split in two.

    ``kv_heads`` below ``n_heads`` shares each key/value head among ``n_heads / kv_heads`` query heads:
    grouped-query attention (Ainslie et al. 2023), multi-query attention at 1 (Shazeer 2019). The
    decoding cache keeps the ``kv_heads`` heads only, which is what the variants are for.
    """

    def __init__(
        self,
        d_model: int,
        *,
        n_heads: int,
        d_k: int,
        d_v: int,
        attn_dropout: float = 0.0,
        self_attention: bool = True,
        kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        kv_heads = n_heads if kv_heads is None else kv_heads
        if not whole(kv_heads, 1) or n_heads % kv_heads:
            raise FieldError("attention.kv_heads", kv_heads, f"must be a whole number that divides n_heads={n_heads}")
        self.n_heads, self.kv_heads, self.d_k, self.d_v = n_heads, kv_heads, d_k, d_v
        self.attn_dropout = attn_dropout
        self.self_attention = self_attention
        if self_attention:
            self.qkv_proj = nn.Linear(d_model, n_heads * d_k + kv_heads * (d_k + d_v))
        else:
            self.q_proj = nn.Linear(d_model, n_heads * d_k)
            self.kv_proj = nn.Linear(d_model, kv_heads * (d_k + d_v))
        self.out_proj = nn.Linear(n_heads * d_v, d_model)
        # While a list, each forward appends its attention weights (B, h, T, S): the fused SDPA kernels
        # never materialise them, so they are recomputed, for inspection only (Transformer.attention_maps).
        self.recorded: list[torch.Tensor] | None = None

    @staticmethod
    def flops(
        *,
        d_model: int,
        n_heads: int,
        d_k: int,
        d_v: int,
        queries: int,
        keys: int,
        kv_heads: int | None = None,
        **args: object,
    ) -> int:
        """Multiply-add FLOPs (2 per MAC) of one attention of ``queries`` over ``keys`` positions: the
        projections and the scores over every key (as the hardware computes them, also where a causal
        mask discards half)."""
        kv = n_heads if kv_heads is None else kv_heads
        projections = queries * d_model * n_heads * d_k + keys * d_model * kv * (d_k + d_v)
        return 2 * (projections + queries * keys * n_heads * (d_k + d_v) + queries * n_heads * d_v * d_model)

    def _heads(self, x: torch.Tensor, head_dim: int, heads: int | None = None) -> torch.Tensor:
        return x.unflatten(-1, (heads or self.n_heads, head_dim)).transpose(1, 2)  # (B, heads, T, head_dim)

    def _shared(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Key/value heads along ``dim`` → query heads: each key/value head serves its group of
        ``n_heads / kv_heads`` query heads ((B, kv_heads, S, d) → (B, n_heads, S, d) by default)."""
        groups = self.n_heads // self.kv_heads
        return x if groups == 1 else x.repeat_interleave(groups, dim=dim)

    def forward(
        self,
        query: torch.Tensor,
        memory: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        causal: bool = False,
        cache: dict[str, torch.Tensor] | None = None,
        packed: tuple[Packing, Packing] | None = None,
        positions: PositionalEncoding | None = None,
    ) -> torch.Tensor:
        """Attend from ``query`` (B, T, d_model) to itself, or to ``memory`` (B, S, d_model).

        ``key_padding_mask`` is (B, S), True where a key is padding. ``causal`` masks future positions
        (§3.2.3): with right-padded targets a causal mask alone is exact for every real position.
        ``cache`` makes decoding incremental: self-attention appends this step's keys and values to
        those of earlier steps; encoder-decoder attention projects ``memory`` once and reuses it.
        ``packed``, the :class:`Packing` of the queries' and the keys' batch, attends over packed
        sequences instead of under ``key_padding_mask`` (not for causal or incremental attention, nor
        with positions that act inside attention); the output is zero at padded query positions.
        ``positions``: the model's :class:`~aiayn.model.positional.PositionalEncoding`, whose rotation
        and score bias self-attention applies.
        """
        in_attention = positions is not None and positions.in_attention
        if packed is not None:
            if causal or cache is not None or in_attention or self.recorded is not None:
                raise ValueError(
                    "packed attention is for teacher-forced attention without a causal mask, a cache, "
                    "positions inside attention or recorded weights"
                )
            return self._packed(query, memory, *packed)
        h, kv, d_k, d_v = self.n_heads, self.kv_heads, self.d_k, self.d_v
        past = 0
        if self.self_attention:
            q, k, v = self.qkv_proj(query).split((h * d_k, kv * d_k, kv * d_v), dim=-1)
            q, k, v = self._heads(q, d_k), self._heads(k, d_k, kv), self._heads(v, d_v, kv)  # (B, heads, T, d)
            if cache is not None and "k" in cache:
                past = cache["k"].size(-2)
            if positions is not None:
                q, k = positions.rotate(q, past), positions.rotate(k, past)
            if cache is not None:
                if past:
                    k, v = torch.cat([cache["k"], k], dim=-2), torch.cat([cache["v"], v], dim=-2)
                cache["k"], cache["v"] = k, v
        else:
            q = self._heads(self.q_proj(query), d_k)  # (B, h, T, d_k)
            if cache is not None and "k" in cache:
                k, v = cache["k"], cache["v"]
            else:
                assert memory is not None, "encoder-decoder attention needs the encoder output"
                k, v = self.kv_proj(memory).split((kv * d_k, kv * d_v), dim=-1)
                k, v = self._heads(k, d_k, kv), self._heads(v, d_v, kv)  # (B, kv_heads, S, d)
                if cache is not None:
                    cache["k"], cache["v"] = k, v
        if past and q.size(-2) > 1:
            raise ValueError("incremental decoding feeds one target position at a time")
        k, v = self._shared(k), self._shared(v)
        bias = positions.bias(q, k.size(-2), past, causal) if self.self_attention and positions is not None else None
        causal = causal and not past  # one new query may see every cached position
        mask = None
        if key_padding_mask is not None:
            mask = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, S), True = may attend
        if causal and (mask is not None or bias is not None):
            future = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
            mask = future if mask is None else mask & future
        if bias is not None:  # an additive mask: the bias where a key may be seen, -inf where not
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        if self.recorded is not None:
            self.recorded.append(attention_weights(q, k, mask, causal))
        # softmax(Q K^T / sqrt(d_k)) V (§3.2.1); SDPA scales by 1/sqrt(d_k) of q's last dimension.
        out = scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=causal and mask is None,
        )  # (B, h, T, d_v)
        return self.out_proj(out.transpose(1, 2).flatten(-2))  # (B, T, d_model)

    def _packed(
        self, query: torch.Tensor, memory: torch.Tensor | None, queries: Packing, keys: Packing
    ) -> torch.Tensor:
        """Non-causal attention over the real positions only: their projections, nested sequences for
        SDPA (no mask), and the output projection, scattered back to the padded (B, T, d_model)."""
        h, kv, d_k, d_v = self.n_heads, self.kv_heads, self.d_k, self.d_v
        batch, width = query.shape[:2]
        if self.self_attention:
            q, k, v = self.qkv_proj(queries.pack(query)).split((h * d_k, kv * d_k, kv * d_v), dim=-1)
            key_width = width
        else:
            assert memory is not None, "encoder-decoder attention needs the encoder output"
            q = self.q_proj(queries.pack(query))
            k, v = self.kv_proj(keys.pack(memory)).split((kv * d_k, kv * d_v), dim=-1)
            key_width = memory.size(1)
        # the nested kernels take as many key/value heads as query heads
        k = self._shared(k.unflatten(-1, (kv, d_k)), dim=-2).flatten(-2)
        v = self._shared(v.unflatten(-1, (kv, d_v)), dim=-2).flatten(-2)
        out = scaled_dot_product_attention(
            queries.nested(q, h, width),
            keys.nested(k, h, key_width),
            keys.nested(v, h, key_width),
            dropout_p=self.attn_dropout if self.training else 0.0,
        )  # (B, h, j, d_v), nested
        return queries.unpack(self.out_proj(out.transpose(1, 2).values().flatten(-2)), batch, width)


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, in fp32 on the CPU under autocast.

    On the CPU, autocast would run SDPA in bf16, whose flash-attention backward is several times slower
    than fp32's (`benchmarks/RESULTS.md`, "bf16 autocast on a CPU that multiplies bf16"); the matrix
    products around it keep bf16.
    """
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **options)
    return F.scaled_dot_product_attention(q, k, v, **options)


def attention_weights(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = False
) -> torch.Tensor:
    """``softmax(Q K^T / sqrt(d_k))`` (B, h, T, S) under the masks SDPA is given: ``mask`` (boolean, True =
    may attend, or additive, broadcast to the scores) and, without it, ``causal``."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if mask is None and causal:
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return scores.softmax(dim=-1)
