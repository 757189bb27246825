"""Whether a set of weights is the model a :class:`TransformerConfig` describes, checked before the
model is built: a config stored beside the weights (a shared checkpoint) may ask for any size, and
building it first would allocate that size."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from aiayn.errors import FieldError
from aiayn.model.config import TransformerConfig
from aiayn.model.transformer import Transformer

# Tables that are computed, not stored (sinusoids, rotations), may hold this many numbers however
# small the weights are: 16M floats, 64 MiB, far beyond any max_positions x d_model a run uses.
COMPUTED_FLOOR = 2**24


def check_weights(cfg: TransformerConfig, weights: Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`~aiayn.errors.FieldError` naming the field of ``cfg`` unless ``weights`` (the
    model's state dict) are exactly the ones ``Transformer(cfg)`` has, name by name and shape by shape,
    and its computed tables are no larger than the weights justify. Nothing of ``cfg``'s size is
    allocated to find out: the stacks are counted from the weights' names before anything is built,
    then the model is built on the meta device (shapes without memory)."""
    for stack, depth, own in (
        ("encoder", cfg.encoder_depth, cfg.encoder_layers),
        ("decoder", cfg.decoder_depth, cfg.decoder_layers),
    ):
        layers = {int(found.group(1)) for name in weights if (found := re.match(rf"{stack}\.(\d+)\.", name))}
        if depth != len(layers):
            field = "n_layers" if own is None else f"{stack}_layers"
            raise FieldError(field, depth, f"does not match the weights, which hold {len(layers)} {stack} layers")
    stored = sum(tensor.numel() for tensor in weights.values() if isinstance(tensor, torch.Tensor))
    per_position = {"sinusoidal": cfg.d_model, "rope": 2 * cfg.d_k}.get(cfg.positional_name or "", 1)
    if cfg.max_positions * per_position > max(stored, COMPUTED_FLOOR):  # output lengths are bounded by it too
        raise FieldError("max_positions", cfg.max_positions, f"needs a position table larger than all {stored} weights")
    with torch.device("meta"):
        expected = {name: tensor.shape for name, tensor in Transformer(cfg).state_dict().items()}
    for name in sorted(set(expected) ^ set(weights)):
        field = "share_embeddings" if "embed" in name or "output_proj" in name else component_field(name)
        state = "is missing from" if name in expected else "is not a weight of"
        raise FieldError(field, getattr(cfg, field), f"does not match the weights: {name} {state} this model")
    for name, shape in expected.items():
        tensor = weights[name]
        if not isinstance(tensor, torch.Tensor) or tensor.shape != shape:
            found = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise FieldError(
                f"weights[{name}]", found, f"is not the shape {tuple(shape)} that the model's settings give"
            )


def component_field(weight: str) -> str:
    """The setting a weight's name belongs to, for a message: ``encoder.0.self_attn.qkv_proj.weight`` →
    ``attention``."""
    parts = weight.split(".")
    if parts[0] == "positions":
        return "positional"
    if any(part in ("self_attn", "cross_attn") for part in parts):
        return "attention"
    if "ffn" in parts:
        return "feed_forward"
    return "norm" if "norm" in parts or weight.startswith(("encoder_norm", "decoder_norm")) else "positional"
