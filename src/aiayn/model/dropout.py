"""Dropout (§5.4) that is cheap on the CPU.

``torch.nn.Dropout`` on the CPU draws a float per element from a serial Bernoulli sampler and keeps a
float mask for the backward pass: at ``model=base`` its 32 dropouts took about a tenth of a training
step on 2 cores (`benchmarks/train_throughput.py`). Here each element gets 16 random bits from one
64-bit draw per four elements, and the backward pass keeps a one-byte mask. The mask multiplies as
``uint8`` (0 or 1): on the CPU that is a vectorised product, where ``masked_fill`` with a boolean mask,
or a product with a ``bool`` tensor, walks the elements one by one at several times its cost (forward
and backward). Other devices, and ``torch.compile`` (whose generated kernels draw random bits in place),
keep PyTorch's dropout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_LEVELS = 1 << 16  # each element compares 16 random bits against a threshold


def _dropped_levels(p: float) -> int:
    """How many of the 2^16 values of 16 random bits drop an element (never all of them)."""
    return min(round(p * _LEVELS), _LEVELS - 1)


def quantized_rate(p: float) -> float:
    """The rate actually applied on the CPU: ``p`` rounded to a multiple of 2^-16 (0.1 → 0.1000061)."""
    return _dropped_levels(p) / _LEVELS


def kept(shape: torch.Size, p: float, device: torch.device) -> torch.Tensor:
    """A ``uint8`` mask of ``shape``: 0 with probability :func:`quantized_rate` (p), else 1, drawn from
    torch's default generator (so ``torch.manual_seed`` and saved RNG states reproduce it)."""
    n = shape.numel()
    bits = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(2**63), None)
    threshold = _dropped_levels(p) - _LEVELS // 2  # int16 values are uniform on ±2^15
    return (bits.view(torch.int16)[:n].view(shape) >= threshold).view(torch.uint8)


class Dropout(nn.Module):
    """``nn.Dropout`` with the same contract: zero each element with probability ``p`` while training
    and scale the rest by 1 / (1 - p), so that the expected output equals the input."""

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability {p} must lie in [0, 1)")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu" or torch.compiler.is_compiling():  # fused kernels draw their own bits
            return F.dropout(x, self.p, training=True)
        rate = quantized_rate(self.p)
        # x * mask, then the scale in place: autograd keeps the one-byte mask for the backward product
        return x.mul(kept(x.shape, self.p, x.device)).mul_(1.0 / (1.0 - rate))

    def extra_repr(self) -> str:
        return f"p={self.p}"
