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

import pytorch_lightning as pl
from hydra.utils import get_class
from lightning_fabric.plugins.precision.precision import _PRECISION_INPUT
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from aiayn.config import compile_flag, model_config
from aiayn.errors import ConfigError, is_number, whole
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
    check_known("trainer", cfg.trainer, *parameters(pl.Trainer))
    check_trainer(cfg.trainer)
    check_known("data", cfg.data, *parameters(get_class(cfg.data._target_)))
    check_data(cfg.data)
    check_lengths(cfg.data, cfg.model)
    check_checkpointing(cfg.checkpoint)
    if cfg.resume is not None and not isinstance(cfg.resume, bool | str):
        raise ConfigError("resume", cfg.resume, "must be true (the latest run of this name), a checkpoint, or null")


def called_with(section: str, function: Callable[..., Any], settings: Mapping[str, Any]) -> None:
    """``function(**settings)``, after :func:`check_known`."""
    check_known(section, settings, *inspect.signature(function).parameters)
    function(**settings)


def check_known(section: str, settings: Mapping[str, Any], *known: str) -> None:
    """A key of ``settings`` not in ``known`` is a setting of ``section`` that does not exist (``+optim.warmpu=10``)."""
    for key, value in settings.items():
        if key not in known and key != "_target_":
            raise ConfigError(f"{section}.{key}", value, f"is not a setting of {section}; those are {', '.join(known)}")


def parameters(target: Callable[..., Any]) -> list[str]:
    """The keyword arguments ``target`` takes; through ``**options``, its base classes' too."""
    names, classes = [], target.__mro__ if isinstance(target, type) else ()
    for owner in classes or (target,):
        if owner is object:
            break
        signature = inspect.signature(owner)
        names += [name for name, p in signature.parameters.items() if p.kind != p.VAR_KEYWORD and name not in names]
        if all(p.kind != p.VAR_KEYWORD for p in signature.parameters.values()):
            break
    return names


def check_resolvable(cfg: DictConfig) -> None:
    """Every value is set (no ``???`` left) and every ``${...}`` interpolation resolves."""
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as error:
        raise ConfigError(error.full_key, "???", "must be set: it has no default") from None
    except OmegaConfBaseException as error:
        raise ConfigError(error.full_key, "...", f"cannot be resolved: {error.msg}") from None


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
    for key, minimum in (("accumulate_grad_batches", 1), ("num_nodes", 1), ("log_every_n_steps", 0)):
        if key in trainer and not whole(trainer[key], minimum):
            raise ConfigError(f"trainer.{key}", trainer[key], f"must be a whole number >= {minimum}")
    if trainer.get("check_val_every_n_epoch") is not None and not whole(trainer.check_val_every_n_epoch, 1):
        raise ConfigError("trainer.check_val_every_n_epoch", trainer.check_val_every_n_epoch, "must be >= 1 or null")
    interval = trainer.get("val_check_interval")
    if interval is not None and not (whole(interval, 1) or (isinstance(interval, float) and 0 < interval <= 1)):
        allowed = "must be a fraction of an epoch in (0, 1] or a whole number of batches >= 1"
        raise ConfigError("trainer.val_check_interval", interval, allowed)
    clip = trainer.get("gradient_clip_val")
    if clip is not None and not (is_number(clip) and clip >= 0):
        raise ConfigError("trainer.gradient_clip_val", clip, "must be a number >= 0 (a norm to clip to) or null")


def check_data(data: DictConfig) -> None:
    """The data module's counts and limits; its sources, languages and splits it checks itself."""
    for key, minimum, null in (
        ("tokenizer_sample", 1, False),
        ("num_workers", 0, False),
        ("encode_workers", 1, True),
        ("train_limit", 1, True),
        ("eval_limit", 1, True),
    ):
        value = data.get(key)
        if not (null and value is None) and not whole(value, minimum):
            raise ConfigError(f"data.{key}", value, f"must be a whole number >= {minimum}{' or null' if null else ''}")
    ratio = data.get("max_len_ratio")
    if ratio is not None and not (is_number(ratio) and ratio >= 1):
        raise ConfigError("data.max_len_ratio", ratio, "must be a number >= 1 (or null: no ratio filter)")


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
