"""Composing the project's Hydra configs in tests, exactly as the console scripts do."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from aiayn.config import config_dir


def compose_config(config_name: str = "train", overrides: list[str] | None = None) -> DictConfig:
    """Compose a config of conf/ exactly as the console scripts do (Hydra's compose API)."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides or [], return_hydra_config=True)
