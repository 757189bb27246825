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
    compile_flag,
    config_keys,
    decoding_options,
    instantiated,
    optim_settings,
    trainer_options,
    transformer_config,
)
from aiayn.config.naming import RunIdentity, run_identity
from aiayn.config.preflight import check_resolvable, check_run_config
from aiayn.config.settings import check_settings
from aiayn.data import TranslationDataModule
from aiayn.data.tokenizer import BOS_ID, EOS_ID
from aiayn.model import DecodingOptions, TransformerConfig
from aiayn.training.callbacks.progress import progress_style
from aiayn.training.callbacks.samples import ValidationSamples
from aiayn.training.module import TranslationModule
from aiayn.training.schedule import OptimSettings


@dataclass(frozen=True)
class ModuleSettings:
    """What :class:`~aiayn.training.module.TranslationModule` is made of: the model, the optimisation,
    the decoding and whether the forward is compiled."""

    model: TransformerConfig
    optim: OptimSettings
    decoding: DecodingOptions
    compile: bool

    def build(self) -> TranslationModule:
        """The module, its initial weights drawn from the generators as they are seeded now."""
        return TranslationModule(self.model, BOS_ID, EOS_ID, self.optim, self.decoding, self.compile)


@dataclass(frozen=True)
class CheckpointPolicy:
    """The ``checkpoint`` section: the checkpoints kept (the best by ``monitor`` in ``mode``, the newest
    ``keep_last`` step checkpoints), the one evaluated after training (``best`` or ``final``), the
    newest ``average_last`` averaged for a second test (§6.1), and a validation every ``every_steps``
    optimizer steps (None: as ``trainer.val_check_interval`` says)."""

    monitor: str
    mode: str
    keep_last: int
    average_last: int
    evaluate: str
    every_steps: int | None


@dataclass
class RunPlan:
    """A training run as its config describes it, each part built and checked once."""

    resolved: dict[str, Any]  # the composed config, resolved: config.yaml, checkpoints, loggers, resume
    module: ModuleSettings
    data: TranslationDataModule  # nothing is read until its prepare_data
    checkpoint: CheckpointPolicy
    trainer: dict[str, Any]  # pl.Trainer's arguments, its strategy and plugins built
    tokens_per_step: int | None  # the effective batch (aiayn.training.batching)
    progress: str  # rich, tqdm or quiet
    samples: ValidationSamples
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
    check_run_config(cfg)
    progress = progress_style(cfg.progress)
    data = instantiated(cfg.data)
    with config_keys("dashboard", {"n_samples": "dashboard.samples"}):
        samples = ValidationSamples(cfg.dashboard.samples, cfg.dashboard.attention_every)
    trainer = trainer_options(cfg.trainer)
    trainer.setdefault("enable_progress_bar", progress != "quiet")  # an explicit trainer.* wins
    trainer.setdefault("enable_model_summary", progress != "quiet")
    return RunPlan(
        resolved=OmegaConf.to_container(cfg, resolve=True),
        module=module,
        data=data,
        checkpoint=CheckpointPolicy(
            monitor=cfg.checkpoint.monitor,
            mode=cfg.checkpoint.mode,
            keep_last=cfg.checkpoint.keep_last,
            average_last=cfg.checkpoint.average_last,
            evaluate=cfg.checkpoint.evaluate,
            every_steps=cfg.checkpoint.every_steps,
        ),
        trainer=trainer,
        tokens_per_step=cfg.tokens_per_step,
        progress=progress,
        samples=samples,
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


def module_settings(cfg: DictConfig) -> ModuleSettings:
    """The module's parts, each checked, in the order a run checks them (also for what builds a module
    without a run: the benchmarks)."""
    model = transformer_config(cfg)
    compile = compile_flag(cfg.model.get("compile", False))
    return ModuleSettings(model, optim_settings(cfg.optim), decoding_options(cfg.decoding), compile)
