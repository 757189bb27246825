"""The Transformer of "Attention Is All You Need" in plain PyTorch: no Lightning, no Hydra."""

from aiayn.model.attention import MultiHeadAttention
from aiayn.model.config import POSITIONAL_ENCODINGS, TransformerConfig
from aiayn.model.decoding import greedy_decode
from aiayn.model.flops import count_parameters, forward_flops, training_flops_per_token
from aiayn.model.transformer import Transformer

__all__ = [
    "POSITIONAL_ENCODINGS",
    "MultiHeadAttention",
    "Transformer",
    "TransformerConfig",
    "count_parameters",
    "forward_flops",
    "greedy_decode",
    "training_flops_per_token",
]
