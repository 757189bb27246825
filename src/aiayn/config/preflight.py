"""Checks of a composed training config that span its parts or need the machine, made before any work.

Each part checks its own settings where it is built, and only there (:class:`~aiayn.model.TransformerConfig`,
:class:`~aiayn.model.DecodingOptions`, :class:`~aiayn.training.schedule.OptimSettings`, the data
modules' sizes, counts and sources), once, in :func:`aiayn.config.plan.plan_run`. What no part can see
alone is checked here: unset or unresolvable values, settings that do not exist, sentence lengths
against the model's positions, the devices against what the machine has, the step, precision and
checkpoint settings, and what a multirun cannot do. Every failure is a :class:`~aiayn.errors.ConfigError`.
"""

from __future__ import annotations

import typing
from typing import Any

import pytorch_lightning as pl
import torch
from hydra.utils import get_class
from lightning_fabric.plugins.precision.precision import _PRECISION_INPUT
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from aiayn.config.build import check_known, parameters
from aiayn.errors import ConfigError, FieldError, is_number, whole
from aiayn.machine import GPU_ACCELERATORS, Devices, available_cpus

# Every value Lightning's `precision` accepts (16, "16-mixed", "bf16-mixed", ...).
PRECISIONS = tuple(value for kind in typing.get_args(_PRECISION_INPUT) for value in typing.get_args(kind))


def check_run_config(cfg: DictConfig) -> None:
    """Raise :class:`~aiayn.errors.ConfigError` for the first setting of ``cfg`` (resolved: :func:`check_resolvable`)
    that cannot work with the others or on this machine."""
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int):
        raise ConfigError("seed", cfg.seed, "must be a whole number")
    if not whole(cfg.max_nonfinite_steps, 1):
        raise ConfigError("max_nonfinite_steps", cfg.max_nonfinite_steps, "must be a whole number of steps >= 1")
    check_known("trainer", cfg.trainer, *parameters(pl.Trainer))
    check_trainer(cfg.trainer)
    check_known("data", cfg.data, *parameters(get_class(cfg.data._target_)))
    check_positions(cfg.data, cfg.model)
    if cfg.resume is not None and not isinstance(cfg.resume, bool | str):
        raise ConfigError("resume", cfg.resume, "must be true (the latest run of this name), a checkpoint, or null")


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


def check_trainer(trainer: DictConfig) -> None:
    """Devices that exist, a precision Lightning knows, step and epoch limits it can use."""
    check_devices(trainer.get("accelerator", "auto"), trainer.get("devices", "auto"), trainer.get("num_nodes", 1))
    precision = trainer.get("precision", "32-true")
    if precision is not None and precision not in PRECISIONS:  # null: Lightning's default, or a plugin's
        raise ConfigError("trainer.precision", precision, "must be one of 32-true, bf16-mixed, 16-mixed, bf16-true")
    for key in ("max_steps", "max_epochs"):
        value = trainer.get(key, -1)
        if value is not None and value != -1 and not whole(value, 1):
            raise ConfigError(f"trainer.{key}", value, "must be a whole number >= 1, or -1 for no limit")
    for key, minimum in (("accumulate_grad_batches", 1), ("log_every_n_steps", 0)):
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


def check_devices(accelerator: str, devices: Any, num_nodes: Any = 1) -> Devices:
    """``trainer.devices`` read (:class:`~aiayn.training.devices.Devices`), failing before any work when it
    asks for devices this machine does not have: GPUs that are not visible, or more DDP processes on the
    CPU than it has cores."""
    try:
        parsed = Devices.parse(devices, num_nodes)
    except FieldError as error:
        raise ConfigError(f"trainer.{error.field}", error.value, error.allowed) from None
    gpus = torch.cuda.device_count()
    kind = "gpu" if accelerator in GPU_ACCELERATORS or (accelerator == "auto" and gpus) else accelerator
    if kind == "gpu" and not gpus:
        raise ConfigError(
            "trainer.accelerator", accelerator, "needs a CUDA GPU; none is visible here (use hardware=cpu)"
        )
    if parsed.count is None:
        return parsed  # every device present
    if parsed.indices is not None:
        if kind == "gpu" and any(index >= gpus for index in parsed.indices):
            raise ConfigError("trainer.devices", devices, f"names a GPU that is not among the {gpus} visible here")
        return parsed
    present = gpus if kind == "gpu" else available_cpus() if kind == "cpu" else None
    what = "GPU(s) visible" if kind == "gpu" else "CPU cores (one per process)"
    if present is not None and parsed.count > present:
        raise ConfigError("trainer.devices", devices, f"is more than the {present} {what} here")
    return parsed
