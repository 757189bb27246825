"""The position-wise feed-forward network (§3.3) and the variants that replaced it: GELU (Hendrycks and
Gimpel 2016) and the gated linear units of Shazeer 2020 (SwiGLU, GEGLU).

A feed-forward component is built as ``cls(d_model, d_ff, activation_dropout=..., **args)`` and maps
(..., d_model) to (..., d_model), position by position."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.errors import FieldError
from aiayn.model.dropout import Dropout

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,  # the paper's max(0, x)
    "gelu": F.gelu,  # x Φ(x), exact (erf)
    "silu": F.silu,  # x σ(x), Swish with β = 1
    "sigmoid": torch.sigmoid,  # Dauphin et al.'s GLU gate
}


def activation_function(name: str, field: str = "feed_forward.activation") -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise FieldError(field, name, f"must be one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class FeedForward(nn.Module):
    """FFN(x) = act(x W1 + b1) W2 + b2, act = max(0, ·) as in §3.3 or GELU, with optional dropout on the
    hidden activations (``activation_dropout``, fairseq's name; not in the paper, whose dropout acts on
    sub-layer outputs)."""

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float = 0.0, activation: str = "relu") -> None:
        super().__init__()
        self.act = activation_function(activation)
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_model)
        self.activation_dropout = Dropout(activation_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.activation_dropout(self.act(self.w1(x))))

    @staticmethod
    def flops(*, d_model: int, d_ff: int, tokens: int, **args: object) -> int:
        """Multiply-add FLOPs (2 per MAC) over ``tokens`` positions."""
        return 4 * tokens * d_model * d_ff


def gated_width(d_ff: int, match_parameters: bool) -> int:
    """The hidden width of a gated network: ``d_ff``, or 2/3 of it so that its three matrices hold the
    parameters (and FLOPs) of the paper's two (Shazeer 2020, §2)."""
    return max(1, round(2 * d_ff / 3)) if match_parameters else d_ff


class GatedFeedForward(nn.Module):
    """FFN_GLU(x) = (act(x W) ⊙ x V) W2 without biases (Shazeer 2020, eq. 5-6): SwiGLU with ``activation=silu``,
    GEGLU with ``gelu``, ReGLU with ``relu``, GLU with ``sigmoid``. ``match_parameters`` narrows the hidden
    width to 2/3 d_ff, as the paper compares at equal parameters."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        activation_dropout: float = 0.0,
        activation: str = "silu",
        match_parameters: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(match_parameters, bool):
            raise FieldError("feed_forward.match_parameters", match_parameters, "must be true or false")
        self.act = activation_function(activation)
        hidden = gated_width(d_ff, match_parameters)
        self.w_gate_value = nn.Linear(d_model, 2 * hidden, bias=False)  # W and V, one product
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.activation_dropout = Dropout(activation_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.w_gate_value(x).chunk(2, dim=-1)
        return self.w2(self.activation_dropout(self.act(gate) * value))

    @staticmethod
    def flops(*, d_model: int, d_ff: int, tokens: int, match_parameters: bool = True, **args: object) -> int:
        return 6 * tokens * d_model * gated_width(d_ff, match_parameters)
