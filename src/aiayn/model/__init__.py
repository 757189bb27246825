"""The Transformer of "Attention Is All You Need" in plain PyTorch: no Lightning, no Hydra, no OmegaConf.

The bottom layer of aiayn: it imports only torch and :mod:`aiayn.errors`, so a researcher can use it in
a loop of their own. Invalid values raise :class:`~aiayn.errors.FieldError` naming the field.
"""

from aiayn.model.attention import (
    DEFAULT_SDPA_BACKENDS,
    SDPA_BACKENDS,
    MultiHeadAttention,
    Packing,
    sdpa_backends,
    use_sdpa_backends,
)
from aiayn.model.beam_search import Hypothesis, beam_search, nbest_search
from aiayn.model.components import register_component
from aiayn.model.config import POSITIONAL_ENCODINGS, TransformerConfig
from aiayn.model.decoding import greedy_decode, search, translate_ids
from aiayn.model.decoding_options import PAPER_DECODING, DecodingOptions, length_penalty
from aiayn.model.ensemble import Ensemble
from aiayn.model.flops import (
    batch_training_flops,
    count_parameters,
    forward_flops,
    parameters_by_component,
    training_flops_per_token,
)
from aiayn.model.positional import PositionalEncoding
from aiayn.model.sampling import sample
from aiayn.model.transformer import Transformer

__all__ = [
    "DEFAULT_SDPA_BACKENDS",
    "PAPER_DECODING",
    "POSITIONAL_ENCODINGS",
    "SDPA_BACKENDS",
    "DecodingOptions",
    "Ensemble",
    "Hypothesis",
    "MultiHeadAttention",
    "Packing",
    "PositionalEncoding",
    "Transformer",
    "TransformerConfig",
    "batch_training_flops",
    "beam_search",
    "count_parameters",
    "forward_flops",
    "greedy_decode",
    "length_penalty",
    "nbest_search",
    "parameters_by_component",
    "register_component",
    "sample",
    "sdpa_backends",
    "search",
    "training_flops_per_token",
    "translate_ids",
    "use_sdpa_backends",
]
