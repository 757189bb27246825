"""The component classes a command may build: those aiayn holds, those the user's own config names
(``model/attention=<entry>`` from a folder on ``hydra.searchpath``), and those a user names for a
checkpoint with ``trust_components=[...]``. Only these imports are made, here; a checkpoint's specs
never import anything (:mod:`aiayn.model.components`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class

from aiayn.errors import ConfigError
from aiayn.model.components import KINDS, is_built_in, register_component, spec_parts


def trust(key: str, target: Any) -> None:
    """Import the class ``target`` names and trust it in this process; ``key`` names it in a message."""
    if not isinstance(target, str) or "." not in target:
        raise ConfigError(key, target, "must be a dotted class name, package.module.Class")
    try:
        cls = get_class(target)
    except Exception as error:
        reason = str(error).splitlines()[0]
        raise ConfigError(key, target, f"cannot be imported ({reason}): put its module on PYTHONPATH") from None
    try:
        register_component(cls, target)  # also by the name given, which may be a package's re-export
    except Exception:  # a FieldError: not a module class
        raise ConfigError(key, target, "is not a torch.nn.Module class") from None


def trust_named(model: Mapping[str, Any]) -> None:
    """Trust the classes the ``model`` section's component specs name (the user's own config chose them)."""
    for kind in KINDS:
        value = model.get(kind)
        if isinstance(value, Mapping) and isinstance(value.get("_target_"), str):
            target, _ = spec_parts(kind, value)
            if not is_built_in(kind, target):
                trust(f"model.{kind}._target_", target)


def trust_listed(targets: Any) -> None:
    """``trust_components``: classes a checkpoint's model names that the user trusts to import."""
    if targets is None:
        return
    if isinstance(targets, str) or not isinstance(targets, list | tuple):
        raise ConfigError("trust_components", targets, "must be a list of dotted class names ([] by default)")
    for target in targets:
        trust("trust_components", target)


def check_choices(model: Mapping[str, Any]) -> None:
    """A group choice ``model/<kind>=<entry>`` that a later value replaced (an experiment setting
    ``model.positional: learned`` after it) is refused, not silently dropped."""
    if not HydraConfig.initialized():
        return
    choices = HydraConfig.get().runtime.choices
    for kind in KINDS:
        choice = choices.get(f"model/{kind}")
        if choice and not isinstance(model.get(kind), Mapping):
            raise ConfigError(
                f"model.{kind}", model.get(kind), f"replaces the choice model/{kind}={choice} (an experiment or "
                f"override sets model.{kind} after it): choose one, model/{kind}=<entry> or model.{kind}=<value>",
            )  # fmt: skip
