"""A composed config → the pieces of a run: the model's and the module's arguments, decoding options,
the data module, the trainer's arguments and the loggers; and the translation of the model layer's
:class:`~aiayn.errors.FieldError` into the :class:`~aiayn.errors.ConfigError` that names the key."""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.loggers import Logger

from aiayn.config.naming import RunIdentity
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.errors import CheckpointError, ConfigError, DataError, FieldError, show
from aiayn.model import DecodingOptions, TransformerConfig
from aiayn.training.loggers import RunCSVLogger

# TransformerConfig's fields that a config sets outside ``model``: the vocabulary is the corpus's.
MODEL_FIELD_KEYS = {"vocab_size": "data.vocab_size"}
_FIELD = re.compile(r"(?<![\w.])([a-z_]+)=")  # a field named in a message: "positional=sinusoidal"


@contextmanager
def config_keys(section: str, keys: Mapping[str, str] | None = None) -> Iterator[None]:
    """A :class:`~aiayn.errors.FieldError` raised inside becomes a :class:`~aiayn.errors.ConfigError` of
    the key ``<section>.<field>`` (or ``keys[field]``); fields its message names are prefixed alike
    (``d_model=511 must be even for positional=sinusoidal`` → ``model.d_model=511 must be even for
    model.positional=sinusoidal``)."""
    keys = keys or {}
    try:
        yield
    except FieldError as error:
        allowed = _FIELD.sub(lambda m: keys.get(m.group(1), f"{section}.{m.group(1)}") + "=", error.allowed)
        raise ConfigError(keys.get(error.field, f"{section}.{error.field}"), error.value, allowed) from None


def called_with(section: str, function: Callable[..., Any], settings: Mapping[str, Any]) -> None:
    """``function(**settings)``, after :func:`check_known`."""
    check_known(section, settings, *inspect.signature(function).parameters)
    function(**settings)


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


def model_config(cfg: DictConfig) -> dict[str, Any]:
    """The fields of :class:`~aiayn.model.TransformerConfig`: ``model.*`` (but ``model.compile``, which
    says how to run the model, not what it is) plus the vocabulary of ``data``."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model.pop("compile", None)
    return {**model, "vocab_size": cfg.data.vocab_size, "pad_id": PAD_ID}


def transformer_config(cfg: DictConfig) -> TransformerConfig:
    """The model ``cfg`` describes; a setting it does not have or a value it cannot take is a
    :class:`ConfigError` naming its key."""
    settings = model_config(cfg)
    check_known("model", settings, *parameters(TransformerConfig))
    with config_keys("model", MODEL_FIELD_KEYS):
        return TransformerConfig(**settings)


def decoding_options(decoding: DictConfig | Mapping[str, Any]) -> DecodingOptions:
    """The ``decoding`` section as :class:`~aiayn.model.DecodingOptions`, checked (``decoding.<field>=...``)."""
    settings = OmegaConf.to_container(decoding, resolve=True) if isinstance(decoding, DictConfig) else dict(decoding)
    check_known("decoding", settings, *parameters(DecodingOptions))
    with config_keys("decoding"):
        return DecodingOptions(**settings)


def compile_flag(value: Any) -> bool:
    """``model.compile``, which must be true or false (a string such as "no" is not taken for true)."""
    if not isinstance(value, bool):
        raise ConfigError("model.compile", value, "must be true or false")
    return value


def module_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """Arguments of :class:`~aiayn.training.module.TranslationModule` from ``model``, ``optim`` and ``decoding``."""
    return {
        "model": model_config(cfg),
        "compile": compile_flag(cfg.model.get("compile", False)),
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        **OmegaConf.to_container(cfg.optim, resolve=True),
        "decoding": decoding_options(cfg.decoding).to_dict(),
    }


def instantiated(spec: DictConfig, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate``, but a target's own :class:`ConfigError` or :class:`DataError` (a
    one-line message naming the key and the fix) is raised as it is, not wrapped into Hydra's exception
    with its traceback."""
    try:
        return instantiate(spec, **kwargs)
    except InstantiationException as error:
        if isinstance(error.__cause__, ConfigError | DataError):
            raise error.__cause__ from None
        raise


# The data sections aiayn-train writes (conf/data/*.yaml): one of these modules, flat, at the top.
STORED_DATA_MODULES = ("Multi30kDataModule", "WMT14DataModule", "TextDataModule")
# Where a stored corpus is: a folder, a Hub dataset, a download's cache. The reader names these, never a
# stored config: a shared file must not make its reader scan a folder or fetch a dataset.
LOCATION_KEYS = ("root", "hub", "cache_dir")
# Stored values that say what the corpus is (not where); each a non-empty string.
NAME_KEYS = ("src_lang", "tgt_lang", "val_split", "test_split", "config")
TEXT_FILE_ROLES = ("train", "val", "test")  # TextDataModule's [source file, target file] pairs
HYDRA_KEYS = ("_target_", "_recursive_", "_convert_")


def instantiated_from_checkpoint(
    spec: Mapping[str, Any],
    section: str,
    checkpoint: Path,
    *,
    root: str | Path | None = None,
    hub: str | None = None,
) -> Any:
    """The data module a ``data`` section stored in ``checkpoint`` (a checkpoint or a run's
    ``config.yaml``) describes, reading the corpus from where the reader says: ``root``, a folder of
    theirs, or ``hub``, a Hugging Face dataset they name (WMT14). Checkpoints and run folders are shared
    between people, so the stored section is taken as a description only:

    - its one ``_target_`` must be one of :data:`STORED_DATA_MODULES`, at the top (no other class, no
      nested object, nothing imported to find out): a stored ``_target_: os.system`` would run as its
      reader;
    - its stored ``root``, ``hub`` and ``cache_dir`` are never used (nothing is scanned, fetched or
      downloaded because a stored file names it), and a stored file name must lie inside ``root``;
    - its values are checked; a wrong one is a :class:`CheckpointError` naming the file and the key.

    Built here, not by ``hydra.utils.instantiate``: the stored values are plain data (the config was
    resolved when the checkpoint was written), and OmegaConf would read an ``${...}`` in them as an
    interpolation, which may call any registered resolver."""
    fix = "evaluate with source=<file> reference=<file>"
    try:
        targets = list(stored_targets(spec, section))
    except RecursionError:
        raise CheckpointError(f"checkpoint {checkpoint}: its stored {section} nests too deep to read; {fix}") from None
    for key, target in targets:
        if key != f"{section}._target_" or _data_module(target) is None:
            raise CheckpointError(
                f"checkpoint {checkpoint}: its stored config sets {key}={show(target)}, which is not one of "
                f"aiayn's data modules ({', '.join(STORED_DATA_MODULES)}, at the top of {section}); it is not "
                f"run ({fix})"
            )
    if not isinstance(spec, Mapping) or "_target_" not in spec:
        raise CheckpointError(f"checkpoint {checkpoint} holds no {section} section to build; {fix}")
    module = _data_module(spec["_target_"])
    settings = {name: value for name, value in spec.items() if name not in (*HYDRA_KEYS, *LOCATION_KEYS)}
    _check_stored_names(settings, module, section, checkpoint, fix)
    settings |= _reader_location(spec, module, section, checkpoint, root, hub)
    try:
        return module(**settings)
    except DataError:
        raise  # a file of the reader's own folder, named with its line
    except ConfigError as error:  # a stored value the module refuses, in the module's own words
        raise CheckpointError(f"checkpoint {checkpoint}: its stored {error}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as error:
        raise CheckpointError(f"checkpoint {checkpoint}: its stored {section} cannot be built: {error}") from None


def stored_targets(node: Any, key: str) -> Iterator[tuple[str, Any]]:
    """Every ``(<key path>._target_, value)`` in a nested mapping or list."""
    if isinstance(node, Mapping):
        for name, value in node.items():
            if name == "_target_":
                yield f"{key}._target_", value
            else:
                yield from stored_targets(value, f"{key}.{name}")
    elif isinstance(node, list | tuple):
        for index, value in enumerate(node):
            yield from stored_targets(value, f"{key}[{index}]")


def _data_module(target: Any) -> type | None:
    """The data module class ``target`` names (``aiayn.data.X`` or ``aiayn.data.datamodule.X``, X one of
    :data:`STORED_DATA_MODULES`), else None."""
    for prefix in ("aiayn.data.", "aiayn.data.datamodule."):
        if isinstance(target, str) and target.startswith(prefix) and target[len(prefix) :] in STORED_DATA_MODULES:
            from aiayn.data import datamodule  # Lightning: imported only when a section is built

            return getattr(datamodule, target[len(prefix) :])
    return None


def _check_stored_names(settings: Mapping[str, Any], module: type, section: str, checkpoint: Path, fix: str) -> None:
    """The stored values that name languages, splits and files have the types the modules take."""

    def refuse(key: str, value: Any, allowed: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {checkpoint}: its stored {section}.{key}={show(value)} {allowed}; {fix}")

    for key in NAME_KEYS:
        if key in settings and not _name(settings[key]):
            raise refuse(key, settings[key], "must be a non-empty string")
        # Languages, split names and WMT14's config become parts of paths under the reader's root.
        if key in settings and (".." in settings[key] or not re.fullmatch(r"[A-Za-z0-9][\w.\-]*", settings[key])):
            raise refuse(key, settings[key], "must be a plain name (letters, digits, '_', '-', '.'; no '/' or '..')")
    if "splits" in settings:  # WMT14's: train and val name splits of the dataset; test may be null
        splits = settings["splits"]
        named = isinstance(splits, Mapping) and set(splits) <= set(TEXT_FILE_ROLES)
        given = (_name(splits.get(role)) or (role == "test" and splits.get(role) is None) for role in TEXT_FILE_ROLES)
        if not named or not all(given):
            raise refuse("splits", splits, "must map train, val (and test, or null) to split names")
    if module.__name__ == "TextDataModule":  # its roles are pairs of file names
        for role in TEXT_FILE_ROLES:
            pair = settings.get(role)
            if pair is not None and not (
                isinstance(pair, list | tuple) and len(pair) == 2 and all(_name(name) for name in pair)
            ):
                raise refuse(role, pair, "must be a list of two file names: [source, target]")


def _name(value: Any) -> bool:
    """``value`` is a non-empty string: a language, a split or a file name."""
    return isinstance(value, str) and bool(value.strip())


def _reader_location(
    spec: Mapping[str, Any], module: type, section: str, checkpoint: Path, root: str | Path | None, hub: str | None
) -> dict[str, Any]:
    """The location settings of ``module``: the reader's ``root`` or ``hub``, checked; the stored
    file names of a text corpus must lie inside ``root``."""
    accepted = inspect.signature(module).parameters
    if hub is not None and not _name(hub):
        raise ConfigError("data.hub", hub, "must be the name of a Hugging Face dataset (or null)")
    if hub is not None and "hub" not in accepted:
        allowed = f"names a Hugging Face dataset, which a {module.__name__} does not read; give data.root=<folder>"
        raise ConfigError("data.hub", hub, allowed)
    if root is not None and hub is not None:
        raise ConfigError("data.hub", hub, f"and data.root={root} name two corpora; give one")
    if root is None and hub is None:
        where = next(
            (f"{section}.{key}={show(spec[key])}" for key in ("root", "hub") if spec.get(key) not in (None, "")),
            f"{section}.root=null (a download)",
        )
        raise CheckpointError(
            f"checkpoint {checkpoint}: its corpus is read only from a folder you name, not from its stored {where}; "
            "set data.root=<your copy of the corpus> (or give source=<file> reference=<file>)"
        )
    if hub is not None:
        return {"hub": hub}
    if not isinstance(root, str | Path) or not str(root).strip() or not Path(root).expanduser().is_dir():
        raise ConfigError("data.root", root, "is not a folder; give your copy of the corpus the checkpoint names")
    folder = os.path.normpath(Path(root).expanduser().absolute())
    for role in TEXT_FILE_ROLES if module.__name__ == "TextDataModule" else ():
        pair = spec.get(role) or ()
        for name in pair:
            # Lexically: an absolute name, or one with "..", must not leave the reader's folder.
            if os.path.commonpath([folder, os.path.normpath(Path(folder) / name)]) != folder:
                raise CheckpointError(
                    f"checkpoint {checkpoint}: its stored {section}.{role}={show(list(pair))} names {name}, outside "
                    f"data.root={root}; put the files in that folder, or give source=<file> reference=<file>"
                )
    return {"root": folder}


def trainer_options(trainer: DictConfig) -> dict[str, Any]:
    """The ``pl.Trainer`` arguments of ``trainer``; ``strategy`` and ``plugins`` entries with a
    ``_target_`` (as in ``hardware/*.yaml``) become the objects they name."""
    return instantiate(trainer, _convert_="all")


def build_loggers(logger_cfg: DictConfig, run_dir: Path, identity: RunIdentity) -> list[Logger]:
    """The CSV logger (``<run_dir>/csv/metrics.csv``) and the loggers of the ``logger`` config group."""
    loggers: list[Logger] = [RunCSVLogger(str(run_dir), name="csv", version="")]
    for key, spec in logger_cfg.items():
        extra: dict[str, Any] = {"save_dir": str(run_dir)}
        if key == "wandb":
            extra |= {"name": spec.get("name") or identity.name, "group": spec.get("group") or identity.group}
        loggers.append(instantiated(spec, **extra))
    return loggers
