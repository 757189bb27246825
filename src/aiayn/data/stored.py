"""Data modules built from a ``data`` section stored in a checkpoint or a run's ``config.yaml``: files that
people share, so the section is read as a description only (no class it names is imported, no location it
names is read). ``aiayn-eval`` and ``aiayn-report`` build the test set of a run they did not train with it.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from aiayn.data import DATA_MODULES
from aiayn.errors import CheckpointError, DataError, FieldError, show
from aiayn.extras import MissingExtra

# Where a stored corpus is: a folder, a Hub dataset, a download's cache. The reader names these, never a
# stored config: a shared file must not make its reader scan a folder or fetch a dataset.
LOCATION_KEYS = ("root", "hub", "cache_dir")
# Stored values that say what the corpus is (not where); each a non-empty string.
NAME_KEYS = ("src_lang", "tgt_lang", "val_split", "test_split", "config")
TEXT_FILE_ROLES = ("train", "val", "test")  # TextDataModule's [source file, target file] pairs
HYDRA_KEYS = ("_target_", "_recursive_", "_convert_")
# Settings of the training pairs only, the extra ones (aiayn.data.back_translation) and their segmentation
# (aiayn.data.bpe_dropout): evaluation builds no training set, and a reader's folder need not hold the
# synthetic files a run trained on.
TRAINING_ONLY_KEYS = ("extra_train", "tag_extra", "upsample_primary", "bpe_dropout")


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

    - its one ``_target_`` must be one of :data:`~aiayn.data.DATA_MODULES` (conf/data's), at the top (no other class, no
      nested object, nothing imported to find out): a stored ``_target_: os.system`` would run as its
      reader;
    - its stored ``root``, ``hub`` and ``cache_dir`` are never used (nothing is scanned, fetched or
      downloaded because a stored file names it), nor its training-only settings (:data:`TRAINING_ONLY_KEYS`),
      and a stored file name must lie inside ``root``;
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
                f"aiayn's data modules ({', '.join(DATA_MODULES)}, at the top of {section}); it is not "
                f"run ({fix})"
            )
    if not isinstance(spec, Mapping) or "_target_" not in spec:
        raise CheckpointError(f"checkpoint {checkpoint} holds no {section} section to build; {fix}")
    module = _data_module(spec["_target_"])
    ignored = (*HYDRA_KEYS, *LOCATION_KEYS, *TRAINING_ONLY_KEYS)
    settings = {name: value for name, value in spec.items() if name not in ignored}
    _check_stored_names(settings, module, section, checkpoint, fix)
    settings |= _reader_location(spec, module, section, checkpoint, root, hub)
    try:
        return module(**settings)
    except (DataError, MissingExtra):
        raise  # a file of the reader's own folder, named with its line; a library this install lacks (WMT's)
    except FieldError as error:  # a stored value the module refuses, named as the stored section's key
        key, allowed = error.named(lambda name: f"{section}.{name}")
        raise CheckpointError(f"checkpoint {checkpoint}: its stored {key}={show(error.value)} {allowed}") from None
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
    :data:`DATA_MODULES`), else None."""
    for prefix in ("aiayn.data.", "aiayn.data.datamodule."):
        if isinstance(target, str) and target.startswith(prefix) and target[len(prefix) :] in DATA_MODULES:
            from aiayn.data import sources  # Lightning: imported only when a section is built

            return getattr(sources, target[len(prefix) :])
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
        raise FieldError("data_hub", hub, "must be the name of a Hugging Face dataset (or null)")
    if hub is not None and "hub" not in accepted:
        allowed = f"names a Hugging Face dataset, which a {module.__name__} does not read; give data_root=<folder>"
        raise FieldError("data_hub", hub, allowed)
    if root is not None and hub is not None:
        raise FieldError("data_hub", hub, f"and data_root={root} name two corpora; give one")
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
        raise FieldError("data_root", root, "is not a folder; give your copy of the corpus the checkpoint names")
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
