"""Every option of every config group composes and instantiates."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from aiayn.config import config_dir, module_kwargs
from aiayn.data import Multi30kDataModule
from aiayn.data.corpus import MULTI30K_SPLITS
from aiayn.model import Transformer, TransformerConfig
from aiayn.module import TranslationModule
from composed import compose_config

CONF = Path(config_dir())


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF / group).glob("*.yaml"))


def test_every_required_option_exists() -> None:
    assert {"tiny", "base", "big"} <= set(options("model"))
    assert {"multi30k_en_de", "multi30k_de_en", "multi30k_en_fr"} <= set(options("data"))
    assert {"cpu", "gpu"} <= set(options("hardware"))
    assert "csv" in options("logger")


@pytest.mark.parametrize("option", options("model"))
def test_model_options_build_a_transformer(option: str) -> None:
    cfg = compose_config("train", [f"model={option}", "data.vocab_size=1000"])
    model_cfg = TransformerConfig(**module_kwargs(cfg)["model"])
    assert model_cfg.d_model == cfg.model.d_model and model_cfg.vocab_size == 1000
    with torch.device("meta"):  # shapes without memory: big has 200M parameters
        model = Transformer(model_cfg)
    assert len(model.encoder) == len(model.decoder) == cfg.model.n_layers


@pytest.mark.parametrize("option", options("data"))
def test_data_options_instantiate_a_datamodule(option: str, tmp_path: Path) -> None:
    cfg = compose_config("train", [f"data={option}", f"data.cache_dir={tmp_path}"])
    datamodule = instantiate(cfg.data)
    assert isinstance(datamodule, Multi30kDataModule)
    src, tgt = option.removeprefix("multi30k_").split("_")
    assert (datamodule.src_lang, datamodule.tgt_lang) == (src, tgt)


@pytest.mark.parametrize("option", options("hardware"))
def test_hardware_options_configure_the_trainer(option: str) -> None:
    cfg = compose_config("train", [f"hardware={option}"])
    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    if kwargs["accelerator"] == "gpu" and not torch.cuda.is_available():
        # No GPU here: check what the Trainer would receive instead of building it.
        assert (kwargs["devices"], kwargs["precision"], cfg.data.pin_memory) == (1, "bf16-mixed", True)
        return
    trainer = pl.Trainer(**kwargs, logger=False, enable_checkpointing=False)
    assert trainer.max_steps == cfg.trainer.max_steps


@pytest.mark.parametrize("option", options("logger"))
def test_logger_options_instantiate(option: str, tmp_path: Path) -> None:
    cfg = compose_config("train", [f"logger={option}"])
    loggers = [instantiate(logger, save_dir=str(tmp_path)) for logger in cfg.logger.values()]
    assert len(loggers) == (0 if option == "none" else 1)
    assert all(isinstance(logger, pl.loggers.Logger) for logger in loggers)


@pytest.mark.parametrize("option", options("experiment"))
def test_experiments_compose_and_instantiate(option: str, tmp_path: Path) -> None:
    cfg = compose_config("train", [f"experiment={option}", f"data.cache_dir={tmp_path}"])
    TranslationModule(**module_kwargs(cfg))
    assert isinstance(instantiate(cfg.data), Multi30kDataModule)
    pl.Trainer(**OmegaConf.to_container(cfg.trainer, resolve=True), logger=False, enable_checkpointing=False)


def test_defaults_are_the_tuned_cpu_run() -> None:
    cfg = compose_config("train")
    assert cfg.trainer.accelerator == "cpu" and cfg.hydra.runtime.choices.model == "small"
    assert cfg.trainer.max_time is not None  # the default run is bounded in wall time
    datamodule = instantiate(cfg.data)
    assert MULTI30K_SPLITS[datamodule.split_names["test"]] == "test_2016_flickr"
