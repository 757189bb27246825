"""What a run's folder and dashboard group are, as Hydra chose them while it composed the config: which
folders the user named (never removed on errors) and the group a sweep's trials or a multirun's jobs share."""

from __future__ import annotations

import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from aiayn.config.naming import RUN_DIR_ENV


def named_by_user(hydra_cfg: DictConfig, node: str) -> bool:
    """``hydra.<node>.dir`` was set on the command line (or by aiayn-sweep for its trial): a folder that
    this command did not reserve (:mod:`aiayn.config.naming`) and never removes."""
    return any(o.startswith(f"hydra.{node}.dir=") for o in hydra_cfg.overrides.hydra) or (
        node == "run" and bool(os.environ.get(RUN_DIR_ENV))
    )


def dashboard_group(cfg: DictConfig) -> str | None:
    """A sweep's trials share ``sweep/<its folder>``; the jobs of one multirun ``multirun/<its start time>``."""
    if cfg.sweep_dir:
        return f"sweep/{Path(cfg.sweep_dir).name}"
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return f"multirun/{Path(HydraConfig.get().sweep.dir).name}"
    return None
