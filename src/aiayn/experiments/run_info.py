"""What a training run records about itself on its dashboards, beside its composed config: the
overrides that define it, the code it ran (git commit, uncommitted changes), its parameter count, the
hardware and precision it ran on and its effective batch; the software versions results.json records."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import Logger

from aiayn.machine import device_name, matmul_precision
from aiayn.model import count_parameters

META_KEY = "aiayn"  # the dashboard config's entry for what the composed config does not hold
# The distributions whose versions decide a run's numbers, as results.json records them.
SOFTWARE = ("aiayn", "torch", "pytorch-lightning", "hydra-core", "wandb", "sentencepiece", "sacrebleu")


def software_versions() -> dict[str, str | None]:
    """The installed version of each of :data:`SOFTWARE` (None where it is not installed as a distribution)."""
    versions: dict[str, str | None] = {}
    for name in SOFTWARE:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def log_run_config(
    loggers: Sequence[Logger],
    config: dict[str, Any],
    overrides: Sequence[str],
    trainer: pl.Trainer,
    model: Any,
    batching: dict[str, Any],
) -> None:
    """Gives every logger ``config`` (the resolved composed config), plus under ``aiayn``: the overrides,
    the code's git commit and dirty flag, the parameter count, the hardware and precision, and the
    effective batch (devices, tokens per device, accumulation)."""
    if not trainer.is_global_zero:  # the other ranks' loggers drop it anyway
        return
    if META_KEY in config:
        raise ValueError(f"the config key {META_KEY!r} is reserved for run metadata; rename it")
    config = dict(config)
    config[META_KEY] = {
        "overrides": list(overrides),
        "git": git_state(Path(__file__).resolve().parent),
        "parameters": count_parameters(model),
        "hardware": describe_hardware(trainer),
        "batch": batching,
    }
    for logger in loggers:
        logger.log_hyperparams(config)


def git_state(path: Path) -> dict[str, Any]:
    """The commit of the git checkout holding ``path`` and whether tracked files differ from it
    (None for both outside a checkout, e.g. an installed wheel)."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


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
