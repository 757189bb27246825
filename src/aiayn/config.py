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
from aiayn.errors import ConfigError
from aiayn.loggers import defining_overrides, run_label

SWEEP_DIR_ENV = "AIAYN_SWEEP_DIR"  # set by aiayn-sweep for its trials: the sweep's folder ...
RUN_DIR_ENV = "AIAYN_RUN_DIR"  # ... and the trial's own folder in it


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
    """The fields of :class:`~aiayn.model.TransformerConfig`: ``model.*`` (but ``model.compile``, which
    says how to run the model, not what it is) plus the vocabulary of ``data``."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model.pop("compile", None)
    return {**model, "vocab_size": cfg.data.vocab_size, "pad_id": PAD_ID}


def compile_flag(value: Any) -> bool:
    """``model.compile``, which must be true or false (a string such as "no" is not taken for true)."""
    if not isinstance(value, bool):
        raise ConfigError("model.compile", value, "must be true or false")
    return value


def module_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """Arguments of :class:`~aiayn.module.TranslationModule` from ``model``, ``optim`` and ``decoding``."""
    return {
        "model": model_config(cfg),
        "compile": compile_flag(cfg.model.get("compile", False)),
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
    """The parameters a sweep sets for this trial: the keys of the file ``wandb agent`` names in
    ``$WANDB_SWEEP_PARAM_PATH``; None outside a sweep or when it is unreadable."""
    path = os.environ.get("WANDB_SWEEP_PARAM_PATH")
    try:
        params = yaml.safe_load(Path(path).read_text()) if path else None
    except (OSError, yaml.YAMLError):
        return None
    return set(params) if isinstance(params, dict) else None


def run_dir(name: str, sweep: str | None, overrides: Sequence[str], now: str, resume: Any = None) -> str:
    """A run's folder: the one aiayn-sweep chose for its trial (``$AIAYN_RUN_DIR``: a trial run again
    continues there from its last checkpoint); under ``wandb agent``, ``<sweep>/<the overrides the sweep
    sets>-<W&B run id>`` (random and bayes may propose one setting twice); with ``resume=true``, the
    latest earlier run of ``name`` that has a last checkpoint (:func:`latest_run`); else
    ``outputs/<name>/<start time>``."""
    if os.environ.get(RUN_DIR_ENV):
        return os.environ[RUN_DIR_ENV]
    if sweep:
        swept = sweep_parameters()
        chosen = [o for o in overrides if o.split("=", 1)[0] in swept] if swept else defining_overrides(overrides)
        run_id = os.environ.get("WANDB_RUN_ID")
        return str(Path(sweep) / (run_label(chosen) + (f"-{run_id}" if run_id else "")))
    fresh = f"outputs/{name}/{now}"
    if resume is True:
        return str(latest_run(Path(fresh).parent) or fresh)
    return fresh


def latest_run(runs: Path) -> Path | None:
    """The run folder under ``runs`` whose ``checkpoints/last.ckpt`` was written last, or None."""
    found = [(last.stat().st_mtime_ns, last.parents[1]) for last in runs.glob("*/checkpoints/last.ckpt")]
    return max(found)[1] if found else None


# conf/train.yaml names these; registered on import, before any entry point composes its config.
OmegaConf.register_new_resolver("aiayn.sweep_dir", sweep_dir, replace=True)
# Cached: the folder is chosen once per run; Lightning reads it again when it starts the DDP ranks, and
# resume=true must not then pick another run's folder.
OmegaConf.register_new_resolver("aiayn.run_dir", run_dir, replace=True, use_cache=True)
