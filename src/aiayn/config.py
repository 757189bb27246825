"""Where the Hydra configs live, and turning a composed config into the pieces of a run."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.loggers import run_label

SWEEP_DIR_ENV = "AIAYN_SWEEP_DIR"  # set by aiayn-sweep for its trials


def config_dir() -> str:
    """``aiayn/conf`` inside an installed wheel, else the repository's top-level ``conf/``."""
    packaged = Path(__file__).resolve().parent / "conf"
    if packaged.is_dir():
        return str(packaged)
    return str(Path(__file__).resolve().parents[2] / "conf")


def compose_config(config_name: str = "train", overrides: Sequence[str] = ()) -> DictConfig:
    """Compose a config of conf/ as the console scripts do (Hydra's compose API), the ``hydra`` node
    included. Hydra raises for unknown keys, groups and options."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)


def compose_run_config(overrides: Sequence[str] = ()) -> DictConfig:
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


def model_config(cfg: DictConfig) -> dict[str, Any]:
    """The fields of :class:`~aiayn.model.TransformerConfig`: ``model.*`` plus the vocabulary of ``data``."""
    return {**OmegaConf.to_container(cfg.model, resolve=True), "vocab_size": cfg.data.vocab_size, "pad_id": PAD_ID}


def module_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """Arguments of :class:`~aiayn.module.TranslationModule` from ``model``, ``optim`` and ``decoding``."""
    return {
        "model": model_config(cfg),
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        **OmegaConf.to_container(cfg.optim, resolve=True),
        **OmegaConf.to_container(cfg.decoding, resolve=True),
    }


def sweep_dir() -> str | None:
    """The folder of the sweep this process is a trial of: ``$AIAYN_SWEEP_DIR`` (aiayn-sweep), else
    ``outputs/sweeps/<sweep id>`` under ``wandb agent`` (which sets ``WANDB_SWEEP_ID``), else None."""
    if os.environ.get(SWEEP_DIR_ENV):
        return os.environ[SWEEP_DIR_ENV]
    if os.environ.get("WANDB_SWEEP_ID"):
        return f"outputs/sweeps/{os.environ['WANDB_SWEEP_ID']}"
    return None


def sweep_parameters() -> set[str] | None:
    """The parameters a sweep sets for this trial: the keys of the file ``wandb agent`` (and aiayn-sweep,
    the same way) names in ``$WANDB_SWEEP_PARAM_PATH``; None outside a sweep or when it is unreadable."""
    path = os.environ.get("WANDB_SWEEP_PARAM_PATH")
    try:
        params = yaml.safe_load(Path(path).read_text()) if path else None
    except (OSError, yaml.YAMLError):
        return None
    return set(params) if isinstance(params, dict) else None


def run_dir(name: str, sweep: str | None, overrides: Sequence[str], now: str) -> str:
    """A run's folder: ``<sweep>/<the overrides its sweep sets>`` for a sweep's trial (a trial run again
    finds its own folder, and continues from its last checkpoint), else ``outputs/<name>/<start time>``."""
    if sweep:
        swept = sweep_parameters()
        if swept is not None:
            overrides = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] in swept]
        return str(Path(sweep) / run_label(list(overrides)))
    return f"outputs/{name}/{now}"


# conf/train.yaml names these; registered on import, before any entry point composes its config.
OmegaConf.register_new_resolver("aiayn.sweep_dir", sweep_dir, replace=True)
OmegaConf.register_new_resolver("aiayn.run_dir", run_dir, replace=True)
