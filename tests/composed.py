"""Composing the project's Hydra configs in tests, exactly as the console scripts do."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from aiayn.config import config_dir


def compose_config(config_name: str = "train", overrides: list[str] | None = None) -> DictConfig:
    """Compose a config of conf/ exactly as the console scripts do (Hydra's compose API)."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides or [], return_hydra_config=True)


def compose_run_config(overrides: list[str] | None = None) -> DictConfig:
    """The training config as ``aiayn-train``'s job sees it, resolved: ``${hydra:...}`` interpolations
    are filled in from Hydra's runtime state, which is then cleared again, and the ``hydra`` node is
    removed."""
    cfg = compose_config("train", overrides)
    HydraConfig.instance().set_config(cfg)
    try:
        with open_dict(cfg):
            del cfg["hydra"]
        OmegaConf.resolve(cfg)
    finally:
        HydraConfig.instance().cfg = None
    return cfg
