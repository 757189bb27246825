"""A config section → the object it describes, checked: the model, decoding and optimizer settings, the
trainer's arguments, the loggers; and the translation of a lower layer's :class:`~aiayn.errors.FieldError`
into the :class:`~aiayn.errors.ConfigError` that names the key. A training run's sections are put
together once, by :func:`aiayn.config.plan.plan_run`."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from aiayn.config.components import check_choices, trust_named
from aiayn.config.naming import RunIdentity
from aiayn.data.tokenizer import PAD_ID
from aiayn.errors import ConfigError, DataError, FieldError
from aiayn.model import DecodingOptions, Transformer, TransformerConfig
from aiayn.training.schedule import OptimSettings

if TYPE_CHECKING:
    from pytorch_lightning.loggers import Logger

# TransformerConfig's fields that a config sets outside ``model``: the vocabulary is the corpus's.
MODEL_FIELD_KEYS = {"vocab_size": "data.vocab_size"}
# Keys of the model section that say how to run the model, not what it is: not in its checkpoint's model.
RUN_FLAGS = ("compile", "packed_attention")


@contextmanager
def config_keys(section: str, keys: Mapping[str, str] | None = None, *, only: bool = False) -> Iterator[None]:
    """A :class:`~aiayn.errors.FieldError` raised inside becomes a :class:`~aiayn.errors.ConfigError` of
    the key ``<section>.<field>`` (or ``keys[field]``; a top-level key where ``section`` is empty); the
    fields its message names (``{field}``, or ``field=`` as in ``d_model=511 must be even for
    positional=sinusoidal`` → ``model.d_model=511 must be even for model.positional=sinusoidal``) alike.
    With ``only``, an error of a field ``keys`` does not name stays what it is (around work that may
    raise about other objects' fields)."""
    mapping = keys or {}

    def key(field: str) -> str:
        return mapping.get(field, f"{section}.{field}" if section else field)

    try:
        yield
    except FieldError as error:
        if only and error.field not in mapping:
            raise
        name, allowed = error.named(key)
        raise ConfigError(name, error.value, allowed) from None


def check_known(section: str, settings: Mapping[str, Any], *known: str) -> None:
    """A key of ``settings`` not in ``known`` is a setting of ``section`` that does not exist (``+optim.warmpu=10``)."""
    for key, value in settings.items():
        if key not in known and key != "_target_":
            raise ConfigError(f"{section}.{key}", value, f"is not a setting of {section}; those are {', '.join(known)}")


def parameters(target: Callable[..., Any]) -> list[str]:
    """The keyword arguments ``target`` takes; through ``**options``, its base classes' too."""
    names, classes = [], target.__mro__ if isinstance(target, type) else ()
    for owner in classes or (target,):
        if owner is object:
            break
        signature = inspect.signature(owner)
        names += [name for name, p in signature.parameters.items() if p.kind != p.VAR_KEYWORD and name not in names]
        if all(p.kind != p.VAR_KEYWORD for p in signature.parameters.values()):
            break
    return names


def transformer_config(cfg: DictConfig) -> TransformerConfig:
    """The model ``cfg`` describes: ``model.*`` (but :data:`RUN_FLAGS`, which say how to run the model,
    not what it is) and the vocabulary of ``data``; a setting it does not have or a value it cannot take
    is a :class:`ConfigError` naming its key."""
    settings = OmegaConf.to_container(cfg.model, resolve=True)
    for key in RUN_FLAGS:
        settings.pop(key, None)
    settings |= {"vocab_size": cfg.data.vocab_size, "pad_id": PAD_ID}
    check_known("model", settings, *parameters(TransformerConfig))
    with config_keys("model", MODEL_FIELD_KEYS):
        check_choices(settings)
        trust_named(settings)
        model = TransformerConfig(**settings)
        with torch.device("meta"):  # every component's arguments checked, nothing allocated
            Transformer(model)
    return model


def decoding_options(decoding: DictConfig | Mapping[str, Any], section: str = "decoding") -> DecodingOptions:
    """The ``decoding`` section (or another of its shape) as :class:`~aiayn.model.DecodingOptions`,
    checked (``<section>.<field>=...``)."""
    settings = OmegaConf.to_container(decoding, resolve=True) if isinstance(decoding, DictConfig) else dict(decoding)
    check_known(section, settings, *parameters(DecodingOptions))
    with config_keys(section):
        return DecodingOptions(**settings)


def validation_decoding(decoding: DictConfig) -> DecodingOptions:
    """The ``val_decoding`` section: how the validations of a fit translate. They rank checkpoints
    (``best.ckpt``), so they search: a BLEU of drawn translations would rank them by chance."""
    options = decoding_options(decoding, "val_decoding")
    if options.sample:
        raise ConfigError(
            "val_decoding.sample",
            True,
            "cannot rank checkpoints by chance draws; set val_decoding=greedy or val_decoding=paper "
            "(val_decoding=same follows decoding, which may sample for the tests)",
        )
    return options


def optim_settings(optim: DictConfig) -> OptimSettings:
    """The ``optim`` section as :class:`~aiayn.training.schedule.OptimSettings`, checked (``optim.<field>=...``)."""
    settings = OmegaConf.to_container(optim, resolve=True)
    check_known("optim", settings, *parameters(OptimSettings))
    with config_keys("optim"):
        return OptimSettings(**settings)


def run_flag(model: DictConfig, key: str) -> bool:
    """``model.<key>``, one of :data:`RUN_FLAGS` (false when absent), which must be true or false (a
    string such as "no" is not taken for true)."""
    value = model.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"model.{key}", value, "must be true or false")
    return value


def instantiated(spec: DictConfig, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate``, but a target's own :class:`ConfigError`, :class:`FieldError` or
    :class:`DataError` (a one-line message naming the key or field and the fix) is raised as it is, not
    wrapped into Hydra's exception with its traceback."""
    try:
        return instantiate(spec, **kwargs)
    except InstantiationException as error:
        if isinstance(error.__cause__, ConfigError | FieldError | DataError):
            raise error.__cause__ from None
        raise


def trainer_options(trainer: DictConfig) -> dict[str, Any]:
    """The ``pl.Trainer`` arguments of ``trainer``; ``strategy`` and ``plugins`` entries with a
    ``_target_`` (as in ``hardware/*.yaml``) become the objects they name."""
    return instantiate(trainer, _convert_="all")


def build_loggers(logger_cfg: DictConfig, run_dir: Path, identity: RunIdentity) -> list[Logger]:
    """The CSV logger (``<run_dir>/csv/metrics.csv``) and the loggers of the ``logger`` config group."""
    from aiayn.training.loggers.csv_logger import RunCSVLogger  # Lightning: only a training run builds loggers

    loggers: list[Logger] = [RunCSVLogger(str(run_dir), name="csv", version="")]
    for key, spec in logger_cfg.items():
        extra: dict[str, Any] = {"save_dir": str(run_dir)}
        if key == "wandb":
            extra |= {"name": spec.get("name") or identity.name, "group": spec.get("group") or identity.group}
        with config_keys(f"logger.{key}"):
            loggers.append(instantiated(spec, **extra))
    return loggers
