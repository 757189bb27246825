"""Checks of a composed training config that span its parts or need the machine, made before any work.

Each part checks its own settings where it is built (:class:`~aiayn.model.TransformerConfig`, the data
modules, the optimizer and decoding options); :func:`check_run_config` adds what none of them can see
alone: unset or unresolvable values, the token budget against the longest sentence training keeps,
sentence lengths against the model's positions, the devices against what the machine has, and the
step, precision and checkpoint settings. Every failure is a :class:`~aiayn.errors.ConfigError`.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

from lightning_fabric.plugins.precision.precision import _PRECISION_INPUT
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from aiayn.config import compile_flag, model_config
from aiayn.errors import ConfigError
from aiayn.hardware import check_devices
from aiayn.model import TransformerConfig
from aiayn.model.decoding import check_decoding
from aiayn.module import check_optimization

# Every value Lightning's `precision` accepts (16, "16-mixed", "bf16-mixed", ...).
PRECISIONS = tuple(value for kind in typing.get_args(_PRECISION_INPUT) for value in typing.get_args(kind))


def check_run_config(cfg: DictConfig) -> None:
    """Raise :class:`~aiayn.errors.ConfigError` for the first setting of ``cfg`` that cannot work."""
    check_resolvable(cfg)
    # The parts' own checks, before the run seeds its generators and draws the initial weights.
    called_with("model", TransformerConfig, model_config(cfg))
    compile_flag(cfg.model.get("compile", False))
    called_with("optim", check_optimization, cfg.optim)
    called_with("decoding", check_decoding, cfg.decoding)
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int):
        raise ConfigError("seed", cfg.seed, "must be a whole number")
    if not whole(cfg.max_nonfinite_steps, 1):
        raise ConfigError("max_nonfinite_steps", cfg.max_nonfinite_steps, "must be a whole number of steps >= 1")
    check_trainer(cfg.trainer)
    check_lengths(cfg.data, cfg.model)
    check_checkpointing(cfg.checkpoint)
    if cfg.resume is not None and not isinstance(cfg.resume, bool | str):
        raise ConfigError("resume", cfg.resume, "must be true (the latest run of this name), a checkpoint, or null")


def called_with(section: str, function: Callable[..., Any], settings: Mapping[str, Any]) -> None:
    """``function(**settings)``, where a key that ``function`` does not take is a setting of ``section``
    that does not exist (``+optim.warmpu=10``)."""
    known = inspect.signature(function).parameters
    for key, value in settings.items():
        if key not in known:
            raise ConfigError(f"{section}.{key}", value, f"is not a setting of {section}; those are {', '.join(known)}")
    function(**settings)


def check_resolvable(cfg: DictConfig) -> None:
    """Every value is set (no ``???`` left) and every ``${...}`` interpolation resolves."""
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as error:
        raise ConfigError(error.full_key, "???", "must be set: it has no default") from None
    except OmegaConfBaseException as error:
        raise ConfigError(error.full_key, "...", f"cannot be resolved: {error.msg}") from None


def whole(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_trainer(trainer: DictConfig) -> None:
    """Devices that exist, a precision Lightning knows, step and epoch limits it can use."""
    check_devices(trainer.get("accelerator", "auto"), trainer.get("devices", "auto"))
    precision = trainer.get("precision", "32-true")
    if precision is not None and precision not in PRECISIONS:  # null: Lightning's default, or a plugin's
        raise ConfigError("trainer.precision", precision, "must be one of 32-true, bf16-mixed, 16-mixed, bf16-true")
    for key in ("max_steps", "max_epochs"):
        value = trainer.get(key, -1)
        if value is not None and value != -1 and not whole(value, 1):
            raise ConfigError(f"trainer.{key}", value, "must be a whole number >= 1, or -1 for no limit")


def check_lengths(data: DictConfig, model: DictConfig) -> None:
    """Every sentence that training keeps fits in a batch, and in the model's positions when they are learned."""
    for key in ("max_tokens", "max_len"):
        if not whole(data[key], 1):
            raise ConfigError(f"data.{key}", data[key], "must be a whole number of tokens >= 1")
    if data.get("eval_max_tokens") is not None and not whole(data.eval_max_tokens, 1):
        raise ConfigError(
            "data.eval_max_tokens", data.eval_max_tokens, "must be a whole number of tokens >= 1 (or null)"
        )
    # A kept pair has at most max_len tokens per side, its end-of-sentence token included.
    if data.max_tokens < data.max_len:
        raise ConfigError(
            "data.max_tokens",
            data.max_tokens,
            f"is smaller than the longest sentence training keeps (data.max_len={data.max_len} tokens); "
            f"raise data.max_tokens or lower data.max_len",
        )
    # Learned positions are a table of max_positions rows (Table 3 row E); sinusoids and rotations extend.
    if model.get("positional") == "learned" and whole(model.max_positions, 1) and data.max_len > model.max_positions:
        raise ConfigError(
            "data.max_len",
            data.max_len,
            f"is longer than model.max_positions={model.max_positions} learned positions; lower it or raise those",
        )


def check_checkpointing(checkpoint: DictConfig) -> None:
    """``checkpoint.keep_last`` and ``checkpoint.average_last`` must fit together."""
    keep, average = checkpoint.keep_last, checkpoint.average_last
    if not whole(keep, 0):
        raise ConfigError("checkpoint.keep_last", keep, "must be a whole number >= 0 (0 keeps no step checkpoints)")
    if not whole(average, 0):
        raise ConfigError("checkpoint.average_last", average, "must be a whole number >= 0 (0 or 1: no averaging)")
    if average > max(keep, 1):
        raise ConfigError(
            "checkpoint.average_last", average, f"needs that many kept checkpoints; set checkpoint.keep_last>={average}"
        )
