"""The model's extension points: attention, feed-forward, normalisation and positional encoding, each a
class named by a spec, ``{"_target_": "package.module.Class", **arguments}`` (Hydra's form, so a config
group entry is a spec).

Which classes a spec may name is the point: a checkpoint carries its specs, and people share
checkpoints, so a target is imported only when it is one of aiayn's built-ins (:data:`BUILT_IN`) or a
class this process registered (:func:`register_component`; the config layer registers those the
user's own config names). A shared checkpoint naming anything else is refused, not imported.

What each kind is called with and must return (``docs/components.md`` has the whole contract):

- ``attention``: ``cls(d_model, *, n_heads, d_k, d_v, attn_dropout, self_attention, **args)``, then
  called like :class:`~aiayn.model.attention.MultiHeadAttention`.
- ``feed_forward``: ``cls(d_model, d_ff, activation_dropout=..., **args)``, (..., d_model) → same.
- ``norm``: ``cls(d_model, **args)``, (..., d_model) → same.
- ``positional``: a :class:`~aiayn.model.positional.PositionalEncoding`, given the keywords its
  constructor names among ``d_model``, ``n_heads``, ``d_k``, ``max_positions``, then ``args``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any

from torch import nn

from aiayn.errors import FieldError, first_line
from aiayn.model.attention import MultiHeadAttention
from aiayn.model.feed_forward import FeedForward, GatedFeedForward
from aiayn.model.positional import (
    ALiBi,
    LearnedPositionalEmbedding,
    PositionalEncoding,
    RotaryEmbedding,
    ShawRelativePositions,
    SinusoidalPositionalEncoding,
    T5RelativeBias,
)

KINDS = ("attention", "feed_forward", "norm", "positional")
# The class each kind takes when its spec is null: the paper's.
PAPER = {"attention": MultiHeadAttention, "feed_forward": FeedForward, "norm": nn.LayerNorm}
# The positional encodings by the names model.positional has always taken, and the newer ones.
POSITIONAL_NAMES: dict[str, type[PositionalEncoding]] = {
    "sinusoidal": SinusoidalPositionalEncoding,
    "learned": LearnedPositionalEmbedding,
    "none": PositionalEncoding,
    "rope": RotaryEmbedding,
    "alibi": ALiBi,
    "t5": T5RelativeBias,
    "shaw": ShawRelativePositions,
}
POSITIONAL_TARGETS = {f"{cls.__module__}.{cls.__qualname__}": name for name, cls in POSITIONAL_NAMES.items()}
BUILT_IN: dict[str, tuple[type[nn.Module], ...]] = {
    "attention": (MultiHeadAttention,),
    "feed_forward": (FeedForward, GatedFeedForward),
    "norm": (nn.LayerNorm, nn.RMSNorm),
    "positional": tuple(POSITIONAL_NAMES.values()),
}
# torch's public names of its classes, besides where they are defined (torch.nn.modules.normalization).
PUBLIC_NAMES = {"torch.nn.LayerNorm": nn.LayerNorm, "torch.nn.RMSNorm": nn.RMSNorm}
BASES: dict[str, type[nn.Module]] = {"positional": PositionalEncoding}
# The class each kind is counted and compared as when a spec names another: the paper's, or no positions.
FALLBACK: dict[str, type[nn.Module]] = PAPER | {"positional": PositionalEncoding}
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
_registered: dict[str, type[nn.Module]] = {}


def target_of(cls: type) -> str:
    """The dotted name a spec gives ``cls`` by: ``aiayn.model.attention.MultiHeadAttention``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_class(kind: str, cls: object) -> type[nn.Module]:
    base = BASES.get(kind, nn.Module)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise FieldError(
            kind, target_of(cls) if isinstance(cls, type) else cls, f"is not a subclass of {target_of(base)}"
        )
    return cls


def register_component(cls: type[nn.Module], name: str | None = None) -> type[nn.Module]:
    """Trust ``cls`` as a component in this process: specs naming it (also those a checkpoint carries)
    build it, by the module that defines it or by ``name``, another dotted name it is imported by (a
    package's re-export). Returns ``cls``, so that it may decorate the class."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise FieldError("component", cls, "must be a torch.nn.Module class")
    _registered[target_of(cls)] = cls
    if name is not None:
        _registered[name] = cls
    return cls


def is_built_in(kind: str, target: str) -> bool:
    """Whether ``target`` names one of aiayn's ``kind`` components (a class nobody needs to trust)."""
    return target in _built_in(kind)


def _built_in(kind: str) -> dict[str, type[nn.Module]]:
    known = {target_of(cls): cls for cls in BUILT_IN[kind]}
    return known | {name: cls for name, cls in PUBLIC_NAMES.items() if cls in BUILT_IN[kind]}


def component_class(kind: str, target: str) -> type[nn.Module]:
    """The class a ``kind`` spec's ``_target_`` names: a built-in or a registered class, never an import
    of anything else."""
    known = _built_in(kind) | _registered
    if target not in known:
        raise FieldError(
            kind, target, "is neither one of aiayn's components nor trusted in this process, and a checkpoint's "
            f"spec is never imported: trust it with trust_components=[{target}] (aiayn-eval, aiayn-translate, "
            "aiayn-export), by naming it in the run's config, or from Python with aiayn.model.register_component",
        )  # fmt: skip
    return _check_class(kind, known[target])


def spec(kind: str, value: Any) -> dict[str, Any]:
    """A ``kind`` component spec as a plain dict, checked for shape only (nothing is imported): a mapping
    whose ``_target_`` is a dotted name and whose other keys are names."""
    target = value.get("_target_") if isinstance(value, Mapping) else None
    if not isinstance(target, str) or len(target) > 200 or not DOTTED.fullmatch(target):
        allowed = "a name of aiayn's or" if kind == "positional" else "null or"
        raise FieldError(kind, value, f"must be {allowed} a spec {{_target_: package.module.Class, <arguments>}}")
    for key in value:
        if not isinstance(key, str) or not (key == "_target_" or key.isidentifier()):
            raise FieldError(kind, value, f"has an argument {key!r} that is not a name")
    return dict(value)


def spec_parts(kind: str, value: Any) -> tuple[str, dict[str, Any]]:
    """A spec's target and arguments, checked by :func:`spec`."""
    checked = spec(kind, value)
    return checked.pop("_target_"), checked


def build(kind: str, value: Mapping[str, Any] | None, *args: Any, **sizes: Any) -> nn.Module:
    """The ``kind`` component the spec ``value`` names (the paper's when None), called with ``args``,
    ``sizes`` (for a positional encoding only those its constructor names) and the spec's arguments; an
    argument the class does not take is a :class:`~aiayn.errors.FieldError` of ``<kind>.<argument>``."""
    if value is None:
        cls, arguments = PAPER[kind], {}
    else:
        target, arguments = spec_parts(kind, value)
        cls = component_class(kind, target)
    accepted = inspect.signature(cls).parameters
    open_ended = any(p.kind == p.VAR_KEYWORD for p in accepted.values())
    if kind == "positional":
        sizes = {key: value for key, value in sizes.items() if key in accepted}
    for key, value in arguments.items():
        if key in sizes or not (key in accepted or open_ended):
            raise FieldError(f"{kind}.{key}", value, f"is not an argument {target_of(cls)} takes")
    try:
        return cls(*args, **sizes, **arguments)
    except FieldError:
        raise
    except (TypeError, ValueError) as error:
        raise FieldError(kind, target_of(cls), f"cannot be built with {arguments}: {first_line(error)}") from None


def cost_class(kind: str, value: Mapping[str, Any] | None) -> tuple[type, dict[str, Any]]:
    """The class whose ``flops`` counts a ``kind`` spec, and the spec's arguments: its own class when it
    is known here and has ``flops``, else the paper's (a user's component that does not count itself is
    counted as the one it replaces)."""
    if value is None:
        return FALLBACK[kind], {}
    target, arguments = spec_parts(kind, value)
    try:
        cls = component_class(kind, target)
    except FieldError:  # not trusted here: nothing of it is imported to count it
        return FALLBACK[kind], {}
    return (cls, arguments) if hasattr(cls, "flops") else (FALLBACK[kind], {})


def is_paper(kind: str, value: Mapping[str, Any] | None) -> bool:
    """Whether a ``kind`` spec builds the paper's component: null, or the paper's class with none but its
    default arguments (``{_target_: torch.nn.LayerNorm}``, ``kv_heads: null``)."""
    if value is None:
        return True
    target, arguments = spec_parts(kind, value)
    cls = _built_in(kind).get(target)
    if cls is None or cls is not PAPER.get(kind):
        return False
    accepted = inspect.signature(cls).parameters
    return all(key in accepted and accepted[key].default == argument for key, argument in arguments.items())


def describe(value: str | Mapping[str, Any] | None) -> str:
    """A spec in a few characters, for messages, reports and model cards: ``MultiHeadAttention(kv_heads=2)``,
    a built-in position by its name (``t5(n_buckets=32, max_distance=128)``); a name stays itself, null is
    ``paper``."""
    if value is None:
        return "paper"
    if isinstance(value, str):
        return value
    target = str(value.get("_target_"))
    name = POSITIONAL_TARGETS.get(target, target.rsplit(".", 1)[-1])
    arguments = ", ".join(f"{key}={argument}" for key, argument in value.items() if key != "_target_")
    return f"{name}({arguments})" if arguments or target not in POSITIONAL_TARGETS else name
