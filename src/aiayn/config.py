"""Where the Hydra configs live, and turning a composed config into the pieces of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID


def config_dir() -> str:
    """``aiayn/conf`` inside an installed wheel, else the repository's top-level ``conf/``."""
    packaged = Path(__file__).resolve().parent / "conf"
    if packaged.is_dir():
        return str(packaged)
    return str(Path(__file__).resolve().parents[2] / "conf")


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
