"""The config of ``aiayn-eval``, ``aiayn-translate`` and ``aiayn-export`` → the typed settings their work
takes (:class:`~aiayn.evaluation.settings.EvalSettings`, :class:`~aiayn.evaluation.settings.TranslateSettings`,
:class:`~aiayn.export.checkpoint.ExportSettings`), made once per command: every setting is checked here,
before any model is loaded or any file written.

A :class:`~aiayn.errors.FieldError` of those settings, or one the work raises later about a field it was
given (a decoding option an engine cannot run, a model setting a format cannot hold), names its key
through :func:`tool_keys`."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from aiayn.config.build import config_keys, decoding_options
from aiayn.config.components import trust_listed
from aiayn.config.settings import check_settings
from aiayn.errors import ConfigError, FieldError
from aiayn.evaluation.comet import CometSettings
from aiayn.evaluation.settings import (
    COMPARED,
    TUNE_SPLIT,
    ComparedSystem,
    DecodeSettings,
    EvalSettings,
    Texts,
    TranslateSettings,
)
from aiayn.evaluation.tuning import TUNABLE, TuneGrid
from aiayn.export.checkpoint import ExportSettings
from aiayn.model import DecodingOptions, TransformerConfig

# The keys of the fields that are not a command's own top-level settings: the decoding options, the
# texts' corpus, and a checkpoint's model (what a format cannot represent is said of its model.<key>).
TOOL_KEYS = {
    **{item.name: f"decoding.{item.name}" for item in fields(DecodingOptions)},
    **{item.name: f"model.{item.name}" for item in fields(TransformerConfig)},
    "data_root": "data.root",
    "data_hub": "data.hub",
    "comet_model": "comet.model",
    "comet_download": "comet.download",
    "comet_batch_size": "comet.batch_size",
}
STREAMS = {"input": "stdin", "output": "stdout"}  # aiayn-translate's files, and what null reads or writes
CHECKPOINT_REQUIRED = "checkpoint=<path to a .ckpt of aiayn-train or aiayn-average> is required"


@contextmanager
def tool_keys() -> Iterator[None]:
    """A :class:`~aiayn.errors.FieldError` raised inside, by the settings or by the work, becomes the
    :class:`~aiayn.errors.ConfigError` of its key: a top-level setting's, else :data:`TOOL_KEYS`'."""
    with config_keys("", TOOL_KEYS):
        yield


def plan_eval(cfg: DictConfig, overrides: Iterable[str] = ()) -> EvalSettings:
    """``aiayn-eval``'s settings; with ``tune.<key>=[...]``, the grid to score on the validation split
    (the split, when not set: the validation split then, else the test split)."""
    check_settings(cfg, "eval", overrides)
    trust_listed(plain(cfg.trust_components))
    with tool_keys():
        decode = decode_settings(cfg)
        grid = tuning_grid(plain(cfg.tune), decode.decoding)
        text = {key: optional_text(cfg, key) for key in ("split", "source", "reference", "data.root", "data.hub")}
        texts = Texts(
            split=text["split"] or (TUNE_SPLIT if grid else "test"),
            source=Path(text["source"]).expanduser() if text["source"] else None,
            reference=Path(text["reference"]).expanduser() if text["reference"] else None,
            data_root=text["data.root"],
            data_hub=text["data.hub"],
        )
        compare = compared_paths(plain(cfg.compare))
        output_dir = optional_text(cfg, "output_dir")
        comet = cfg.comet
        return EvalSettings(
            decode,
            texts,
            tokenized_bleu=cfg.tokenized_bleu,
            compare=ComparedSystem.of(compare) if compare else None,
            output_dir=Path(output_dir).expanduser() if output_dir else None,
            tune=grid,
            comet=CometSettings(comet.model, comet.download, comet.batch_size) if comet.model is not None else None,
        )


def plan_translate(cfg: DictConfig, overrides: Iterable[str] = ()) -> TranslateSettings:
    """``aiayn-translate``'s settings."""
    check_settings(cfg, "translate", overrides)
    trust_listed(plain(cfg.trust_components))
    with tool_keys():
        files = {key: optional_text(cfg, key, f"must be a file (or null: {stream})") for key, stream in STREAMS.items()}
        return TranslateSettings(
            decode_settings(cfg),
            input=Path(files["input"]).expanduser() if files["input"] else None,
            output=Path(files["output"]).expanduser() if files["output"] else None,
            buffer_lines=cfg.buffer_lines,
        )


def plan_export(cfg: DictConfig, overrides: Iterable[str] = ()) -> ExportSettings:
    """``aiayn-export``'s settings."""
    check_settings(cfg, "export", overrides)
    trust_listed(plain(cfg.trust_components))
    with tool_keys():
        checkpoint = required_checkpoint(cfg.checkpoint)
        if not cfg.output or not isinstance(cfg.output, str):
            raise ConfigError("output", cfg.output, "must be the path of a new folder to write the model to")
        push_to = optional_text(cfg, "push_to", "must be a Hub repository id, <user or org>/<name> (or null)")
        return ExportSettings(checkpoint, cfg.format, Path(cfg.output).expanduser(), cfg.quantization, push_to)


def decode_settings(cfg: DictConfig) -> DecodeSettings:
    """Which model translates and how: the settings ``aiayn-eval`` and ``aiayn-translate`` share."""
    checkpoint = plain(cfg.checkpoint)
    many = isinstance(checkpoint, Sequence) and not isinstance(checkpoint, str)
    return DecodeSettings(
        tuple(required_checkpoint(path) for path in checkpoint) if many else (required_checkpoint(checkpoint),),
        decoding_options(cfg.decoding),
        backend=cfg.backend,
        compute_type=cfg.compute_type,
        device=cfg.device,
        max_tokens=cfg.max_tokens,
        nbest=cfg.nbest,
        seed=cfg.seed,
        sdpa_backends=plain(cfg.sdpa_backends),
    )


def required_checkpoint(checkpoint: Any) -> Path:
    """``checkpoint=<path>``, which a tool that loads a model needs."""
    if not checkpoint:
        raise ValueError(CHECKPOINT_REQUIRED)
    if not isinstance(checkpoint, str):
        raise ConfigError("checkpoint", checkpoint, "must be a path (a .ckpt of aiayn-train or aiayn-average)")
    return Path(checkpoint)


def compared_paths(value: Any) -> tuple[Path, ...]:
    """``compare=``: nothing (null), a path, or a list of checkpoints (an ensemble)."""
    if value is None:
        return ()
    values = list(value) if isinstance(value, list | tuple) else [value]
    if not values or not all(isinstance(item, str) and item for item in values):
        raise ConfigError("compare", value, f"must be {COMPARED}; or [a.ckpt,b.ckpt], an ensemble")
    return tuple(Path(item) for item in values)


def optional_text(cfg: DictConfig, key: str, allowed: str = "must be a path or a name (or null)") -> str | None:
    """The setting ``key``: a string that is not blank, or null."""
    value = OmegaConf.select(cfg, key)
    if value is not None and not (isinstance(value, str) and value.strip()):
        raise ConfigError(key, value, "must be train, val or test" if key == "split" else allowed)
    return value


def plain(value: object) -> object:
    """A config value as plain Python (a list, a dict)."""
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def tuning_grid(tune: Mapping[str, Any] | None, decoding: DecodingOptions) -> TuneGrid | None:
    """``tune=`` (a decoding setting → a list of values, or one value; null: ``decoding``'s own) as every
    combination of its values over ``decoding``, each checked as :class:`DecodingOptions` are; None when
    nothing is tuned. A key that is no decoding setting, an empty list or a value a setting cannot take
    (``tune.beam_size=[0]``) is a :class:`ConfigError` of its key."""
    tune = dict(tune or {})
    for key, value in tune.items():
        if key not in TUNABLE:
            allowed = f"is not a decoding setting to tune; those are {', '.join(TUNABLE)}"
            raise ConfigError(f"tune.{key}", value, allowed)
    values: dict[str, list[Any]] = {}
    for key in TUNABLE:
        value = tune.get(key)
        if value is None:
            continue
        listed = list(value) if isinstance(value, list | tuple) else [value]
        if not listed or any(isinstance(item, list | tuple | dict) or item is None for item in listed):
            raise ConfigError(f"tune.{key}", value, "must be a list of values to try ([0.6,1.0]), or null")
        values[key] = list(dict.fromkeys(listed))  # a value listed twice is tried once
    if not values:
        return None
    settings = []
    for combination in itertools.product(*values.values()):
        try:
            settings.append(replace(decoding, **dict(zip(values, combination, strict=True))))
        except FieldError as error:
            key = f"tune.{error.field}" if error.field in values else f"decoding.{error.field}"
            raise ConfigError(key, error.value, error.allowed) from None
    return TuneGrid(decoding, values, settings)
