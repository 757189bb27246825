"""Which GPUs each of a sweep's trials runs on: every running trial gets devices of its own, as many as its
config's ``trainer.devices`` asks for, through ``CUDA_VISIBLE_DEVICES`` (inside the trial, Lightning then
sees them as devices 0..n-1).

The runner's devices are the GPUs it sees: ``$AIAYN_SWEEP_DEVICES`` when set (a comma-separated list of
device indices or UUIDs: a share of a node, or a simulated machine), else ``$CUDA_VISIBLE_DEVICES``, else
every CUDA device. A machine without any keeps the CPU-only behaviour: trials share the CPU's threads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from aiayn.errors import FieldError
from aiayn.machine import GPU_ACCELERATORS, Devices

DEVICES_ENV = "AIAYN_SWEEP_DEVICES"


class PlacementError(ValueError):
    """A trial that can never be placed on this runner's devices; the message says why and what to do."""


def runner_devices() -> list[str]:
    """The devices the runner places trials on (see the module's docstring)."""
    for name in (DEVICES_ENV, "CUDA_VISIBLE_DEVICES"):
        listed = os.environ.get(name)
        if listed is not None:
            return [device.strip() for device in listed.split(",") if device.strip()]
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]


def devices_needed(trainer: Any, available: int) -> int:
    """How many of the runner's ``available`` devices a trial whose ``trainer`` section this is takes: its
    ``trainer.devices`` on a GPU accelerator (``auto`` counts as one where there are GPUs, as Lightning
    decides), every device for ``-1``/``auto``, none on the CPU."""
    accelerator = str(trainer.get("accelerator", "auto"))
    if accelerator not in GPU_ACCELERATORS and not (accelerator == "auto" and available):
        return 0
    try:
        devices = Devices.parse(trainer.get("devices", "auto"), trainer.get("num_nodes", 1))
    except FieldError as error:
        raise PlacementError(f"trainer.{error}") from None
    if devices.nodes > 1:
        raise PlacementError(
            f"trainer.num_nodes={devices.nodes} runs on several nodes; send the sweep to SLURM (--launcher slurm)"
        )
    if devices.indices is not None:
        raise PlacementError(
            f"trainer.devices={trainer.devices} names devices, and the sweep places its trials itself: give how "
            "many (trainer.devices=2)"
        )
    return available if devices.count is None else devices.count


class DevicePool:
    """The runner's devices, each held by at most one running trial."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = list(devices)
        self.free = list(devices)

    def take(self, n: int) -> list[str] | None:
        """``n`` free devices (the lowest first), now held; None while fewer than ``n`` are free."""
        if n > len(self.devices):
            raise PlacementError(
                f"it needs {n} devices and this runner has {len(self.devices)} ({', '.join(self.devices) or 'none'}); "
                f"lower trainer.devices or run the sweep where there are more (${DEVICES_ENV} lists them)"
            )
        if n > len(self.free):
            return None
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def hold(self, devices: Sequence[str]) -> list[str]:
        """Take ``devices`` (a trial's recorded ones, which a process started before still uses) where they
        are this pool's and free; returns those taken (``sweep.json`` may name others)."""
        held = [device for device in devices if device in self.free]
        self.free = [device for device in self.free if device not in held]
        return held

    def give_back(self, devices: Sequence[str]) -> None:
        self.free = sorted({*self.free, *(d for d in devices if d in self.devices)}, key=self.devices.index)
