"""The ``trainer`` section's settings that aiayn interprets, checked once when made: the devices (and so
the run's world size), the precision, the step and epoch limits, the validation intervals, the
accumulation and the clipping. Every other ``pl.Trainer`` argument passes through as given."""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields
from typing import Any

import torch
from lightning_fabric.plugins.precision.precision import _PRECISION_INPUT

from aiayn.errors import FieldError, is_number, whole
from aiayn.machine import GPU_ACCELERATORS, Devices, available_cpus

# Every value Lightning's `precision` accepts (16, "16-mixed", "bf16-mixed", ...).
PRECISIONS = tuple(value for kind in typing.get_args(_PRECISION_INPUT) for value in typing.get_args(kind))


@dataclass(frozen=True)
class TrainerSettings:
    """Devices that exist here, a precision Lightning knows, step and epoch limits and intervals it can
    use; a value that cannot work is a :class:`~aiayn.errors.FieldError` naming the field."""

    accelerator: str = "auto"
    devices: Any = "auto"
    num_nodes: Any = 1
    precision: Any = "32-true"  # None: Lightning's default, or a plugin's
    max_steps: Any = -1
    max_epochs: Any = -1
    accumulate_grad_batches: Any = 1
    log_every_n_steps: Any = 50
    check_val_every_n_epoch: Any = 1
    val_check_interval: Any = None
    gradient_clip_val: Any = None

    @classmethod
    def of(cls, trainer: typing.Mapping[str, Any]) -> TrainerSettings:
        """The settings among ``trainer``'s keys (pl.Trainer's arguments); the others are not aiayn's."""
        return cls(**{field.name: trainer[field.name] for field in fields(cls) if field.name in trainer})

    def __post_init__(self) -> None:
        self._check_devices()
        if self.precision is not None and self.precision not in PRECISIONS:
            raise FieldError("precision", self.precision, "must be one of 32-true, bf16-mixed, 16-mixed, bf16-true")
        for name in ("max_steps", "max_epochs"):
            value = getattr(self, name)
            if value is not None and value != -1 and not whole(value, 1):
                raise FieldError(name, value, "must be a whole number >= 1, or -1 for no limit")
        for name, minimum in (("accumulate_grad_batches", 1), ("log_every_n_steps", 0)):
            if not whole(getattr(self, name), minimum):
                raise FieldError(name, getattr(self, name), f"must be a whole number >= {minimum}")
        if self.check_val_every_n_epoch is not None and not whole(self.check_val_every_n_epoch, 1):
            raise FieldError("check_val_every_n_epoch", self.check_val_every_n_epoch, "must be >= 1 or null")
        interval = self.val_check_interval
        if interval is not None and not (whole(interval, 1) or (isinstance(interval, float) and 0 < interval <= 1)):
            allowed = "must be a fraction of an epoch in (0, 1] or a whole number of batches >= 1"
            raise FieldError("val_check_interval", interval, allowed)
        clip = self.gradient_clip_val
        if clip is not None and not (is_number(clip) and clip >= 0):
            raise FieldError("gradient_clip_val", clip, "must be a number >= 0 (a norm to clip to) or null")

    @property
    def parsed_devices(self) -> Devices:
        return Devices.parse(self.devices, self.num_nodes)

    @property
    def world_size(self) -> int:
        """The processes the run trains in, as Lightning will count them."""
        return self.parsed_devices.world_size(str(self.accelerator))

    def _check_devices(self) -> None:
        """Devices this machine has: GPUs that are visible, no more DDP processes on the CPU than cores."""
        devices = self.parsed_devices
        gpus = torch.cuda.device_count()
        accelerator = self.accelerator
        kind = "gpu" if accelerator in GPU_ACCELERATORS or (accelerator == "auto" and gpus) else accelerator
        if kind == "gpu" and not gpus:
            raise FieldError("accelerator", accelerator, "needs a CUDA GPU; none is visible here (use hardware=cpu)")
        if devices.count is None:
            return  # every device present
        if devices.indices is not None:
            if kind == "gpu" and any(index >= gpus for index in devices.indices):
                raise FieldError("devices", self.devices, f"names a GPU that is not among the {gpus} visible here")
            return
        present = gpus if kind == "gpu" else available_cpus() if kind == "cpu" else None
        what = "GPU(s) visible" if kind == "gpu" else "CPU cores (one per process)"
        if present is not None and devices.count > present:
            raise FieldError("devices", self.devices, f"is more than the {present} {what} here")
