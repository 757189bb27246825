"""A composed training config → the plan of a run: every setting checked and turned into the typed
object the layer below takes, once, before any work (:func:`plan_run`). The layers below raise
:class:`~aiayn.errors.FieldError` about their own fields; here they become the
:class:`~aiayn.errors.ConfigError` that names the key (``optim.warmup=0 must be ...``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from aiayn.config.build import (
    check_known,
    config_keys,
    decoding_options,
    instantiated,
    optim_settings,
    parameters,
    run_flag,
    trainer_options,
    transformer_config,
    validation_decoding,
)
from aiayn.config.naming import RunIdentity, run_identity
from aiayn.config.preflight import check_resolvable, check_run_config
from aiayn.config.settings import check_settings
from aiayn.data import TranslationDataModule
from aiayn.data.tokenizer import BOS_ID, EOS_ID
from aiayn.errors import ConfigError
from aiayn.model import DecodingOptions, TransformerConfig
from aiayn.model.components import component_class, describe
from aiayn.training.batching import BatchSettings, plan_batches, trainer_arguments
from aiayn.training.callbacks.ema import EmaSettings
from aiayn.training.callbacks.garbage import ScheduledCollection
from aiayn.training.callbacks.progress import progress_style
from aiayn.training.callbacks.samples import ValidationSamples
from aiayn.training.callbacks.sdpa import SdpaBackends
from aiayn.training.checkpoint_policy import CheckpointPolicy
from aiayn.training.module import TranslationModule
from aiayn.training.schedule import DECAYING, OptimSettings

# The keys of the fields that the run's work refuses once the corpus is read: a vocabulary the corpus
# cannot fill, a validation interval longer than an epoch, a loader kept across epochs with BPE-dropout.
FIT_KEYS = {
    "vocab_size": "data.vocab_size",
    "bpe_dropout": "data.bpe_dropout",
    "val_check_interval": "trainer.val_check_interval",
    "reload_dataloaders_every_n_epochs": "trainer.reload_dataloaders_every_n_epochs",
    "every_steps": "checkpoint.every_steps",
}


@dataclass(frozen=True)
class ModuleSettings:
    """What :class:`~aiayn.training.module.TranslationModule` is made of: the model, the optimisation,
    the decoding (the tests', and the validations' while training), whether the forward is compiled and
    whether its attention runs over packed sequences."""

    model: TransformerConfig
    optim: OptimSettings
    decoding: DecodingOptions
    compile: bool
    val_decoding: DecodingOptions
    packed_attention: bool = False

    def build(self) -> TranslationModule:
        """The module, its initial weights drawn from the generators as they are seeded now."""
        return TranslationModule(
            self.model,
            BOS_ID,
            EOS_ID,
            self.optim,
            self.decoding,
            self.compile,
            val_decoding=self.val_decoding,
            packed_attention=self.packed_attention,
        )


# The config's keys of the batch settings' fields (aiayn.training.batching), which its errors name.
BATCH_KEYS = {
    "tokens_per_step": "tokens_per_step",
    "max_tokens": "data.max_tokens",
    "cap": "micro_batch_cap",
    "max_len": "data.max_len",
    "accumulate": "trainer.accumulate_grad_batches",
}


@dataclass
class RunPlan:
    """A training run as its config describes it, each part built and checked once."""

    resolved: dict[str, Any]  # the composed config, resolved: config.yaml, checkpoints, loggers, resume
    module: ModuleSettings
    data: TranslationDataModule  # nothing is read until its prepare_data
    checkpoint: CheckpointPolicy
    ema: EmaSettings  # an exponential moving average of the weights, or none (decay null or 0)
    trainer: dict[str, Any]  # pl.Trainer's arguments, its strategy and plugins built
    batching: dict[str, Any]  # the effective batch and the micro-batches that form it (aiayn.training.batching)
    world_size: int  # the processes trainer.devices and trainer.num_nodes make, which the Trainer must match
    progress: str  # rich, tqdm or quiet
    samples: ValidationSamples
    sdpa: SdpaBackends  # the attention kernels the run allows
    collection: ScheduledCollection | None  # Python's garbage collection between steps; None: Python's own
    seed: int
    max_nonfinite_steps: int
    peak_tflops: float | None
    callbacks: DictConfig  # the config's own callbacks, to instantiate
    logger: DictConfig  # the logger group's loggers, to instantiate in the run folder
    identity: RunIdentity  # the run's name and group on the dashboards
    resume: bool | str | None
    overrides: list[str]  # the command line's, which define the run
    own_overrides: list[str] | None  # a multirun's job's or a sweep's trial's: its folder continues only its run


def plan_run(cfg: DictConfig, overrides: Sequence[str] = (), group: str | None = None) -> RunPlan:
    """The plan of the run ``cfg`` describes; the first setting that cannot work is a
    :class:`~aiayn.errors.ConfigError` (or the data module's :class:`~aiayn.errors.DataError`) naming its
    key. ``overrides`` (the command line's) name the run on the dashboard and ``group`` (its sweep's or
    multirun's) groups it; a grouped run's folder is its overrides'."""
    check_resolvable(cfg)
    check_settings(cfg, "train", overrides)  # a key added with + that nothing reads: +seeds=3, +ckpt_path=...
    module = module_settings(cfg)
    trainer_settings = check_run_config(cfg)
    check_decay_budget(module.optim, cfg.trainer)
    checkpoint = checkpoint_policy(cfg.checkpoint)
    with config_keys("", BATCH_KEYS):  # the other fields named: top-level keys (progress)
        progress = progress_style(cfg.progress)
        batch = BatchSettings(cfg.tokens_per_step, cfg.data.max_tokens, cfg.micro_batch_cap, cfg.data.max_len)
        batching = plan_batches(batch, trainer_settings.world_size, trainer_settings.accumulate_grad_batches)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    # data.max_tokens=null: the device's share; the stored config (config.yaml, checkpoints) holds it, as what
    # the run trained on and what a resume must match.
    resolved["data"]["max_tokens"] = batching["max_tokens_per_device"]
    with config_keys("data"):
        data = instantiated(cfg.data, max_tokens=batching["max_tokens_per_device"])
    with config_keys("", {"every": "gc_every"}):
        sdpa = SdpaBackends(
            OmegaConf.to_container(cfg.sdpa_backends) if OmegaConf.is_config(cfg.sdpa_backends) else cfg.sdpa_backends
        )
        collection = ScheduledCollection(cfg.gc_every) if cfg.gc_every is not None else None
    with config_keys("dashboard", {"n_samples": "dashboard.samples"}):
        samples = ValidationSamples(cfg.dashboard.samples, cfg.dashboard.attention_every)
    with config_keys("trainer", FIT_KEYS):
        trainer = data.trainer_options(trainer_options(cfg.trainer))  # data.bpe_dropout: a loader per epoch
    trainer |= trainer_arguments(batching, checkpoint.every_steps)
    trainer.setdefault("enable_progress_bar", progress != "quiet")  # an explicit trainer.* wins
    trainer.setdefault("enable_model_summary", progress != "quiet")
    ema = ema_settings(cfg.ema)
    if checkpoint.answer == "ema" and not ema.decay:
        raise ConfigError("checkpoint.answer", "ema", "needs an EMA of the weights: set ema.decay (e.g. 0.999)")
    return RunPlan(
        resolved=resolved,
        module=module,
        data=data,
        checkpoint=checkpoint,
        ema=ema,
        trainer=trainer,
        batching=batching,
        world_size=batching["world_size"],
        progress=progress,
        samples=samples,
        sdpa=sdpa,
        collection=collection,
        seed=cfg.seed,
        max_nonfinite_steps=cfg.max_nonfinite_steps,
        peak_tflops=cfg.peak_tflops,
        callbacks=cfg.callbacks,
        logger=cfg.logger,
        identity=run_identity(cfg.name, overrides, group),
        resume=cfg.resume,
        overrides=list(overrides),
        own_overrides=list(overrides) if group else None,
    )


# The key of what the checkpoint policy's messages name beyond its own section.
CHECKPOINT_KEYS = {"decay": "ema.decay"}


def checkpoint_policy(section: DictConfig) -> CheckpointPolicy:
    """The ``checkpoint`` section, checked (:class:`~aiayn.training.checkpoint_policy.CheckpointPolicy`)."""
    with config_keys("checkpoint", CHECKPOINT_KEYS):
        return CheckpointPolicy(
            monitor=section.monitor,
            mode=section.mode,
            keep_last=section.keep_last,
            average_last=section.average_last,
            evaluate=section.evaluate,
            every_steps=section.every_steps,
            average_every=section.average_every,
            answer=section.answer,
        )


def check_decay_budget(optim: OptimSettings, trainer: DictConfig) -> None:
    """A decaying schedule reaches ``optim.min_lr`` when the run ends: a run without a step or time
    limit has no end for it to reach (epochs alone are not counted in steps before the data is read)."""
    if optim.schedule in DECAYING and trainer.get("max_steps", -1) in (-1, None) and trainer.get("max_time") is None:
        raise ConfigError(
            "optim.schedule", optim.schedule, "decays until the run ends: set trainer.max_steps or trainer.max_time"
        )


def module_settings(cfg: DictConfig) -> ModuleSettings:
    """The module's parts, each checked, in the order a run checks them (also for what builds a module
    without a run: the benchmarks)."""
    model = transformer_config(cfg)
    compile, packed = run_flag(cfg.model, "compile"), run_flag(cfg.model, "packed_attention")
    if packed and component_class("positional", model.positional_spec["_target_"]).in_attention:
        raise ConfigError(
            "model.packed_attention",
            True,
            f"cannot apply positions inside attention (model.positional={describe(model.positional)}): set it to false",
        )
    decoding = decoding_options(cfg.decoding)
    optim, val_decoding = optim_settings(cfg.optim), validation_decoding(cfg.val_decoding)
    for section, options in (("decoding", decoding), ("val_decoding", val_decoding)):
        if options.mbr:
            allowed = "is for aiayn-eval and aiayn-translate: a run validates and tests with its search; set it there"
            raise ConfigError(f"{section}.mbr", options.mbr, allowed)
    return ModuleSettings(model, optim, decoding, compile, val_decoding, packed)


def ema_settings(ema: Any) -> EmaSettings:
    """The ``ema`` section as :class:`~aiayn.training.callbacks.ema.EmaSettings`, checked (``ema.<field>=...``)."""
    if not isinstance(ema, DictConfig):  # ema=0.999 replaces the section with a number
        raise ConfigError("ema", ema, "is a section: set ema.decay (and ema.start_step)")
    settings = OmegaConf.to_container(ema, resolve=True)
    check_known("ema", settings, *parameters(EmaSettings))
    with config_keys("ema"):
        return EmaSettings(**settings)
