"""Every option of every config group composes and instantiates."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from hydra.utils import get_class, instantiate

from aiayn.config.build import transformer_config
from aiayn.config.compose import compose_config, config_dir
from aiayn.config.plan import checkpoint_policy, module_settings, plan_run
from aiayn.data import Multi30kDataModule, TextDataModule, TranslationDataModule, WMT14DataModule
from aiayn.data.corpus import MULTI30K_SPLITS
from aiayn.model import Transformer
from helpers.compose import composed_run

CONF = Path(config_dir())


def options(group: str, nested: bool = True) -> list[str]:
    """The options of a config group (files starting with ``_`` are shared parts, not options), with
    those of its nested groups (``experiment/mini/E``) unless not ``nested``."""
    folder = CONF / group
    paths = (
        path.relative_to(folder).with_suffix("") for path in folder.rglob("*.yaml") if nested or path.parent == folder
    )
    return sorted(path.as_posix() for path in paths if not path.name.startswith("_"))


def test_every_required_option_exists() -> None:
    assert {"tiny", "base", "big"} <= set(options("model"))
    assert {"multi30k_en_de", "multi30k_de_en", "multi30k_en_fr", "wmt14_en_de", "wmt14_en_fr", "text"} <= set(
        options("data")
    )
    assert {"cpu", "cpu_ddp", "gpu", "gpu8_ddp", "slurm"} <= set(options("hardware"))
    paper = {f"paper/{size}_wmt14_{pair}" for size in ("base", "big") for pair in ("en_de", "en_fr")}
    assert paper <= set(options("experiment"))
    assert {"wandb", "tensorboard", "none"} <= set(options("logger"))


@pytest.mark.parametrize("option", options("model", nested=False))
def test_model_options_build_a_transformer(option: str) -> None:
    cfg = compose_config("train", [f"model={option}", "data.vocab_size=1000"])
    model_cfg = transformer_config(cfg)
    assert model_cfg.d_model == cfg.model.d_model and model_cfg.vocab_size == 1000
    with torch.device("meta"):  # shapes without memory: big has 200M parameters
        model = Transformer(model_cfg)
    assert len(model.encoder) == len(model.decoder) == cfg.model.n_layers


@pytest.mark.parametrize("component", [name for name in options("model") if "/" in name])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_each_component_entry_builds_the_class_it_names_in_every_layer(component: str, norm_first: bool) -> None:
    kind, entry = component.split("/")
    overrides = ["model=tiny", f"model/{kind}={entry}", "data.vocab_size=1000", f"model.norm_first={norm_first}"]
    cfg = compose_config("train", overrides)
    spec = cfg.model[kind]
    model = Transformer(transformer_config(cfg)).eval()
    logits = model(torch.tensor([[5, 6, 7, 3, 0]]), torch.tensor([[2, 9, 10]]))
    assert logits.shape == (1, 3, 1000) and torch.isfinite(logits).all()
    built = {
        "attention": [layer.self_attn for layer in model.encoder] + [layer.cross_attn for layer in model.decoder],
        "feed_forward": [layer.ffn for layer in [*model.encoder, *model.decoder]],
        "norm": [layer.ffn_block.norm for layer in [*model.encoder, *model.decoder]],
        "positional": [model.positions],
    }[kind]
    assert {type(module) for module in built} == {get_class(spec["_target_"])}


@pytest.mark.parametrize("option", options("data"))
def test_data_options_instantiate_a_datamodule(option: str, tmp_path: Path) -> None:
    overrides = [f"data={option}", f"data.cache_dir={tmp_path}"]
    if option == "text":
        for name in ("a.en", "a.it", "b.en", "b.it"):
            (tmp_path / name).write_text("ciao\n")
        overrides += ["data.src_lang=en", "data.tgt_lang=it", f"data.root={tmp_path}"]
        overrides += ["data.train=[a.en,a.it]", "data.val=[b.en,b.it]"]
    cfg = compose_config("train", overrides)
    datamodule = instantiate(cfg.data)  # nothing is read or downloaded until prepare_data
    kind = {"multi30k": Multi30kDataModule, "wmt14": WMT14DataModule, "text": TextDataModule}
    assert isinstance(datamodule, kind[option.split("_")[0]])
    if option != "text":
        src, tgt = option.split("_")[1:]
        assert (datamodule.src_lang, datamodule.tgt_lang) == (src, tgt)
    assert datamodule.vocab_size == {"wmt14_en_de": 37000, "wmt14_en_fr": 32000}.get(option, 5000)  # §5.1


@pytest.mark.slow
@pytest.mark.parametrize("option", options("experiment"))
def test_experiments_compose_and_instantiate(option: str) -> None:
    cfg = composed_run([f"experiment={option}"])  # as aiayn-train's job sees it; test_layout reads the same
    with torch.device("meta"):  # the module's shapes, without initialising up to 213M parameters
        module = module_settings(cfg).build()
    assert (module.model.cfg.d_model, module.model.cfg.n_layers) == (cfg.model.d_model, cfg.model.n_layers)
    assert module.model.cfg.vocab_size == cfg.data.vocab_size
    plan = plan_run(cfg)  # the data module as a run makes it: data.max_tokens=null takes the largest share
    assert isinstance(plan.data, TranslationDataModule)
    trainer = pl.Trainer(**plan.trainer, logger=False, enable_checkpointing=False)
    assert trainer.max_steps == cfg.trainer.max_steps and trainer.world_size == plan.world_size
    batching = plan.batching
    assert trainer.accumulate_grad_batches == batching["accumulation"]
    if cfg.tokens_per_step is None:
        assert trainer.accumulate_grad_batches == cfg.trainer.accumulate_grad_batches
    else:  # the paper's 25000 tokens in one micro-batch on this one device
        assert batching["max_tokens_per_step"] == batching["max_tokens_per_device"] == cfg.tokens_per_step


def test_defaults_are_the_tuned_cpu_run() -> None:
    cfg = compose_config("train")
    assert cfg.trainer.accelerator == "cpu" and cfg.hydra.runtime.choices.model == "small"
    assert cfg.trainer.max_time is not None  # the default run is bounded in wall time
    datamodule = instantiate(cfg.data)
    assert MULTI30K_SPLITS[datamodule.split_names["test"]] == "test_2016_flickr"


@pytest.mark.parametrize(("option", "beam_size"), [("paper", 4), ("greedy", 1)])
def test_decoding_options_reach_the_module(option: str, beam_size: int) -> None:
    cfg = compose_config("train", [f"decoding={option}", "model=tiny", "data.vocab_size=1000"])
    module = module_settings(cfg).build()
    assert module.decoding.beam_size == beam_size and module.decoding.max_len_offset == 50
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
        module_settings(cfg).build()


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
        checkpoint_policy(cfg.checkpoint)
