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
from aiayn.train import check_checkpointing
from composed import compose_config

CONF = Path(config_dir())


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF / group).glob("*.yaml"))


def test_every_required_option_exists() -> None:
    assert {"tiny", "base", "big"} <= set(options("model"))
    assert {"multi30k_en_de", "multi30k_de_en", "multi30k_en_fr"} <= set(options("data"))
    assert {"cpu", "gpu"} <= set(options("hardware"))
    assert {"wandb", "tensorboard", "none"} <= set(options("logger"))


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


@pytest.mark.parametrize(("option", "beam_size"), [("paper", 4), ("greedy", 1)])
def test_decoding_options_reach_the_module(option: str, beam_size: int) -> None:
    cfg = compose_config("train", [f"decoding={option}", "model=tiny", "data.vocab_size=1000"])
    module = TranslationModule(**module_kwargs(cfg))
    assert module.hparams.beam_size == beam_size and module.hparams.max_len_offset == 50
    for tool in ("eval", "translate"):  # the other tools compose the same group
        assert compose_config(tool, [f"decoding={option}", "checkpoint=x.ckpt"]).decoding.beam_size == beam_size


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("decoding.beam_size=0", "decoding.beam_size=0 must be a whole number >= 1"),
        ("decoding.alpha=-0.5", "decoding.alpha=-0.5 must be a number >= 0"),
        ("decoding.max_len_offset=-1", "decoding.max_len_offset=-1 must be a whole number >= 0"),
    ],
)
def test_bad_decoding_options_fail_when_the_module_is_built(override: str, message: str) -> None:
    cfg = compose_config("train", [override, "model=tiny", "data.vocab_size=1000"])
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        TranslationModule(**module_kwargs(cfg))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["checkpoint.average_last=8"],
            r"checkpoint\.average_last=8 needs that many kept checkpoints; set checkpoint\.keep_last>=8",
        ),
        (["checkpoint.keep_last=-1"], r"checkpoint\.keep_last=-1 must be a whole number >= 0"),
    ],
)
def test_checkpoint_averaging_that_cannot_happen_fails_before_training(overrides: list[str], message: str) -> None:
    cfg = compose_config("train", overrides)
    with pytest.raises(ValueError, match=message):
        check_checkpointing(cfg.checkpoint)
