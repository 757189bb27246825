"""What a run trains on: a description for the dashboard, and the peak FLOP/s that MFU divides by."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from aiayn.cpus import available_cpus
from aiayn.errors import ConfigError

# Dense peak tensor-core TFLOP/s per device from the vendors' data sheets (no structured sparsity), by
# the arithmetic a precision setting runs the matrix products in. The first name contained in the
# device name wins, so more specific names come first.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def matmul_precision(precision: str) -> str:
    """The arithmetic of the matrix products under a Lightning ``precision`` setting."""
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    # fp32 matrix products run as TF32 on tensor cores unless the "highest" precision is asked for.
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak_flops(device_name: str, precision: str, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device, or None when neither ``override_tflops`` nor the table knows it."""
    if override_tflops is not None:
        return override_tflops * 1e12
    arithmetic = matmul_precision(precision)
    for name, peaks in PEAK_TFLOPS.items():
        if name in device_name:
            tflops = peaks.get(arithmetic)
            return tflops * 1e12 if tflops is not None else None
    return None


def check_devices(accelerator: str, devices: Any) -> None:
    """Fail before any work when ``trainer.devices`` asks for devices this machine does not have: GPUs
    that are not visible, or more DDP processes on the CPU than it has cores."""
    gpus = torch.cuda.device_count()
    kind = "gpu" if accelerator in ("gpu", "cuda") or (accelerator == "auto" and gpus) else accelerator
    if kind == "gpu" and not gpus:
        raise ConfigError(
            "trainer.accelerator", accelerator, "needs a CUDA GPU; none is visible here (use hardware=cpu)"
        )
    if devices in ("auto", -1, "-1"):
        return  # every device present
    present = gpus if kind == "gpu" else available_cpus() if kind == "cpu" else None
    what = "GPU(s) visible" if kind == "gpu" else "CPU cores (one per process)"
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise ConfigError("trainer.devices", devices, "must be a number of devices >= 1, -1 or auto (all)")
        if present is not None and devices > present:
            raise ConfigError("trainer.devices", devices, f"is more than the {present} {what} here")
        return
    try:  # a list of device indices, or Lightning's "0,1"
        indices = [int(i) for i in (devices.split(",") if isinstance(devices, str) else devices) if str(i).strip()]
    except (TypeError, ValueError):
        raise ConfigError(
            "trainer.devices", devices, "must be a number of devices, a list of indices, -1 or auto"
        ) from None
    if kind == "gpu" and any(not 0 <= i < gpus for i in indices):
        raise ConfigError("trainer.devices", devices, f"names a GPU that is not among the {gpus} visible here")


@functools.cache
def device_name(device: torch.device) -> str:
    """The GPU's marketing name, or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def describe_hardware(trainer: pl.Trainer) -> dict[str, Any]:
    """Devices, precision and software versions of a run, as the dashboard shows them."""
    device = trainer.strategy.root_device
    return {
        "accelerator": device.type,
        "device": device_name(device),
        "devices_per_node": trainer.num_devices,
        "num_nodes": trainer.num_nodes,
        "world_size": trainer.world_size,
        "precision": str(trainer.precision),
        "matmul_precision": matmul_precision(str(trainer.precision)),
        "cpu_cores": os.cpu_count(),
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
    }
