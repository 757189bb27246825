"""Checks of a composed training config that span its parts or need the machine, made before any work.

Each part checks its own settings where it is built, and only there (:class:`~aiayn.model.TransformerConfig`,
:class:`~aiayn.model.DecodingOptions`, :class:`~aiayn.training.schedule.OptimSettings`, the data
modules' sizes, counts and sources), once, in :func:`aiayn.config.plan.plan_run`. What no part can see
alone is checked here: unset or unresolvable values, settings that do not exist, sentence lengths
against the model's positions, and what a multirun cannot do; the trainer's settings
(:class:`~aiayn.training.trainer_settings.TrainerSettings`: the devices against what the machine has, the
limits, the precision) are made here and named ``trainer.*``. Every failure is a
:class:`~aiayn.errors.ConfigError`.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from aiayn.config.build import check_known, config_keys, parameters
from aiayn.errors import ConfigError, whole
from aiayn.training.trainer_settings import TrainerSettings


def check_run_config(cfg: DictConfig) -> TrainerSettings:
    """Raise :class:`~aiayn.errors.ConfigError` for the first setting of ``cfg`` (resolved: :func:`check_resolvable`)
    that cannot work with the others or on this machine; the trainer's settings, checked."""
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int):
        raise ConfigError("seed", cfg.seed, "must be a whole number")
    if not whole(cfg.max_nonfinite_steps, 1):
        raise ConfigError("max_nonfinite_steps", cfg.max_nonfinite_steps, "must be a whole number of steps >= 1")
    check_known("trainer", cfg.trainer, *parameters(pl.Trainer))
    trainer = check_trainer(cfg.trainer)
    check_known("data", cfg.data, *parameters(get_class(cfg.data._target_)))
    check_positions(cfg.data, cfg.model)
    if cfg.resume is not None and not isinstance(cfg.resume, bool | str):
        raise ConfigError("resume", cfg.resume, "must be true (the latest run of this name), a checkpoint, or null")
    return trainer


def check_multirun_resume(resume: Any, sweep_dir: str | None, multirun: bool) -> None:
    """``resume=true`` picks the latest run of a name: one run, which the jobs of a multirun (``-m``) cannot
    all continue (an aiayn-sweep's trials, under ``sweep_dir``, continue their own folders)."""
    if multirun and resume is True and not sweep_dir:
        allowed = "continues one run: drop -m (a multirun's jobs continue in their folders when it runs again "
        raise ConfigError("resume", True, allowed + "with the same hydra.sweep.dir)")


def check_resolvable(cfg: DictConfig) -> None:
    """Every value is set (no ``???`` left) and every ``${...}`` interpolation resolves."""
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as error:
        raise ConfigError(error.full_key, "???", "must be set: it has no default") from None
    except OmegaConfBaseException as error:
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, ConfigError):  # OmegaConf re-raises, in except blocks
            cause = cause.__cause__ or cause.__context__
        if cause is not None:  # a resolver's own check (aiayn.cpu_precision)
            raise cause from None
        raise ConfigError(error.full_key, "...", f"cannot be resolved: {error.msg}") from None


def check_trainer(trainer: DictConfig) -> TrainerSettings:
    """The trainer section's settings aiayn interprets (:class:`~aiayn.training.trainer_settings.TrainerSettings`),
    checked, with errors naming ``trainer.<key>``."""
    with config_keys("trainer"):
        return TrainerSettings.of(trainer)


def check_positions(data: DictConfig, model: DictConfig) -> None:
    """Every sentence training keeps fits in the model's positions when they are learned (Table 3 row E:
    a table of ``max_positions`` rows; sinusoids and rotations extend)."""
    max_len, positions = data.get("max_len"), model.get("max_positions")
    if model.get("positional") == "learned" and whole(max_len, 1) and whole(positions, 1) and max_len > positions:
        raise ConfigError(
            "data.max_len",
            max_len,
            f"is longer than model.max_positions={positions} learned positions; lower it or raise those",
        )
