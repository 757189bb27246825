"""What this machine has: the CPUs a process may use, the device names, and the peak FLOP/s that MFU
divides by. A leaf: data, training and the config checks use it."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch


def available_cpus() -> int:
    """The CPUs this process may run on: a SLURM job's or a container's share, not the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS and Windows have no affinity masks
        return os.cpu_count() or 1


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
