"""Checkpoints of a run: the newest ones, their average (§6.1), and loading one for translation.

Every checkpoint that ``aiayn-train`` writes carries, under :data:`RUN_KEY`, the run's resolved config
and the sentencepiece model, so that a single ``.ckpt`` file is enough to translate or evaluate.
Periodic checkpoints are named ``step<global step>.ckpt``.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from collections.abc import Sequence
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import torch

from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import CheckpointError, FieldError, first_line, show, whole
from aiayn.files import atomic_write
from aiayn.model import Transformer, TransformerConfig
from aiayn.model.weights import check_weights
from aiayn.training.checkpoint_limits import check_checkpoint_limits

log = logging.getLogger(__name__)

RUN_KEY = "aiayn"  # {"config": resolved run config, "tokenizer": serialized sentencepiece model, ...}
OVERRIDES_KEY = "overrides"  # RUN_KEY entry: the command line's overrides, which define the run
DATA_KEY = "data_cache"  # RUN_KEY entry: the name of the data's cache entry (corpus digest, vocabulary)
BATCH_KEY = "batch_layout"  # RUN_KEY entry: aiayn.training.batching.batch_layout
STEP_NAME = "step{step:07d}"  # ModelCheckpoint filename template of the periodic checkpoints
STEP_FILE = re.compile(r"^step(\d+)\.ckpt$")  # the names STEP_NAME gives
_PROTOCOL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")  # file://, local://, s3://, simplecache::s3://
# Training state that an averaged checkpoint does not carry: it is for evaluation, not for resuming.
_TRAINING_STATE = ("optimizer_states", "lr_schedulers", "loops", "callbacks", "MixedPrecision")
RESUMABLE = ("state_dict", "optimizer_states", "loops")  # what a run continues from must hold


def step_checkpoints(run: Path) -> list[Path]:
    """The periodic checkpoints of a run folder (or of its ``checkpoints/`` folder), oldest first."""
    folder = run / "checkpoints" if (run / "checkpoints").is_dir() else run
    if not folder.is_dir():
        raise CheckpointError(f"{run} is not a folder; give a run folder or its checkpoints/ folder")
    found = [(int(m.group(1)), path) for path in folder.iterdir() if (m := STEP_FILE.match(path.name))]
    return [path for _, path in sorted(found)]


def load_checkpoint(path: Path, mmap: bool = False) -> dict[str, Any]:
    """A checkpoint's contents, on the CPU, read with ``weights_only=True``: tensors and plain data only,
    so that a checkpoint from elsewhere cannot run code. ``mmap`` maps tensors instead of reading them
    (enough to check a checkpoint). A missing, truncated or foreign file is a :class:`CheckpointError`, and
    so is one over the bounds of :mod:`~aiayn.training.checkpoint_limits`, refused before torch reads it."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a folder; give a .ckpt file (e.g. {path}/checkpoints/best.ckpt)")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    check_checkpoint_limits(path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        if found:
            raise CheckpointError(
                f"checkpoint {path} holds {found.group(1)} objects, not only tensors and plain data; those "
                "are not loaded (weights_only=True): it was not written by aiayn-train or aiayn-average"
            ) from None
        detail = re.search(r"WeightsUnpickler error:\s*(.+)", str(error))
        raise CheckpointError(
            f"checkpoint {path} cannot be read; it is truncated or not a PyTorch checkpoint "
            f"({detail.group(1).strip() if detail else first_line(error)})"
        ) from None
    except Exception as error:  # torch raises several types for truncated or foreign files
        raise CheckpointError(
            f"checkpoint {path} cannot be read; it is truncated or not a PyTorch checkpoint ({first_line(error)})"
        ) from None
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(checkpoint).__name__}, not a checkpoint's dict")
    check_tensor_sizes(checkpoint, path)
    return checkpoint


def check_tensor_sizes(node: Any, path: Path, field: str = "", depth: int = 0, seen: set[int] | None = None) -> None:
    """Every tensor in ``node`` holds its own numbers: a tensor whose storage is smaller than its size (an
    expanded one, stride 0) loads from a few bytes as terabytes, and any copy of it (a cast, an average)
    allocates them all. A :class:`CheckpointError` names the first such tensor (and a nesting deeper
    than aiayn writes). Each container is walked once (``seen``: their ids), so a pickle's references to
    earlier containers do not make the walk longer than the pickle; field names are cut to 80 characters."""
    if depth > 32:
        raise CheckpointError(f"checkpoint {path}: {field or 'its contents'} nest deeper than aiayn writes")
    seen = set() if seen is None else seen
    if isinstance(node, dict | list | tuple):
        if id(node) in seen:
            return
        seen.add(id(node))
    if isinstance(node, dict):
        for key, value in node.items():
            check_tensor_sizes(value, path, (f"{field}.{key}" if field else str(key))[:80], depth + 1, seen)
    elif isinstance(node, list | tuple):
        for index, value in enumerate(node):
            check_tensor_sizes(value, path, f"{field}[{index}]"[:80], depth + 1, seen)
    elif isinstance(node, torch.Tensor) and (
        node.layout is not torch.strided or node.device.type != "cpu" or node.is_quantized or node.is_nested
    ):
        raise CheckpointError(
            f"checkpoint {path}: {field} is a {node.layout} tensor on {node.device.type}; aiayn writes dense "
            "tensors of the CPU"
        )
    elif isinstance(node, torch.Tensor) and node.numel() * node.element_size() > node.untyped_storage().nbytes():
        raise CheckpointError(
            f"checkpoint {path}: {field} is a tensor of {node.numel()} numbers stored in "
            f"{node.untyped_storage().nbytes()} bytes (expanded); aiayn writes every number it means"
        )


def run_entry(checkpoint: dict[str, Any], path: Path) -> dict[str, Any]:
    """The checkpoint's :data:`RUN_KEY` entry with each part of the type aiayn writes (a mapping of
    its config, the tokenizer's bytes, the overrides, the cache entry's name, the batch layout);
    a shared file's other types end in one line naming the field."""
    run = checkpoint.get(RUN_KEY, {})
    types = {"config": dict, "tokenizer": bytes, OVERRIDES_KEY: list, DATA_KEY: str, BATCH_KEY: dict}
    if not isinstance(run, dict):
        raise CheckpointError(f"checkpoint {path}: {RUN_KEY}={type(run).__name__} is not the mapping aiayn writes")
    for key, kind in types.items():
        if run.get(key) is not None and not isinstance(run[key], kind):
            raise CheckpointError(
                f"checkpoint {path}: {RUN_KEY}.{key}={type(run[key]).__name__} is not the {kind.__name__} aiayn writes"
            )
    if any(not isinstance(item, str) for item in run.get(OVERRIDES_KEY) or []):
        raise CheckpointError(f"checkpoint {path}: {RUN_KEY}.{OVERRIDES_KEY} holds other things than overrides")
    if any(not isinstance(k, str) or not whole(v, 0) for k, v in (run.get(BATCH_KEY) or {}).items()):
        raise CheckpointError(f"checkpoint {path}: {RUN_KEY}.{BATCH_KEY} holds other things than whole numbers")
    if not _plain_data(run.get("config") or {}):
        raise CheckpointError(
            f"checkpoint {path}: {RUN_KEY}.config holds other things than a resolved config (names as keys; "
            "strings, numbers, flags, null and lists as values; a few levels deep)"
        )
    return run


def _plain_data(node: Any, depth: int = 0) -> bool:
    """A config as ``OmegaConf.to_container`` gives it: string keys, JSON-like values, not too deep."""
    if depth > 16:
        return False
    if isinstance(node, dict):
        return all(isinstance(key, str) and _plain_data(value, depth + 1) for key, value in node.items())
    if isinstance(node, list):
        return all(_plain_data(value, depth + 1) for value in node)
    return node is None or isinstance(node, str | bool | int | float)


def check_resumable(path: Path) -> dict[str, Any]:
    """``path``'s contents (tensors mapped, not read), which must hold the whole training state (weights,
    optimizer, loops); else a :class:`CheckpointError` that says which checkpoint could be used. Whether
    it is the training of this run's settings is :mod:`aiayn.experiments.resume`'s to check."""
    try:
        checkpoint = load_checkpoint(path, mmap=True)
    except CheckpointError as error:
        raise CheckpointError(f"{error}; {earlier_checkpoints(path)}") from None
    missing = [key for key in RESUMABLE if key not in checkpoint]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} has no training state ({', '.join(missing)}): it cannot be resumed "
            "(an averaged checkpoint is for aiayn-eval and aiayn-translate)"
        )
    step = checkpoint.get("global_step", 0)
    if not whole(step, 0):
        raise CheckpointError(f"checkpoint {path}: global_step={step!r:.40} is not a whole number of steps")
    run_entry(checkpoint, path)
    return checkpoint


def earlier_checkpoints(path: Path) -> str:
    """Advice after ``path`` proved unreadable: the newest other checkpoint of its folder that loads and
    that a run can continue from (a step checkpoint of a validation, else ``best.ckpt``; the weights-only
    snapshots of ``checkpoint.average_every`` are for averaging)."""
    folder = path.parent
    found = [*reversed(step_checkpoints(folder)), folder / "best.ckpt"] if folder.is_dir() else []
    for other in [other for other in found if other != path and other.is_file()]:
        try:
            checkpoint = load_checkpoint(other, mmap=True)
        except CheckpointError:
            continue
        if all(key in checkpoint for key in RESUMABLE):
            return f"the newest readable checkpoint of the run is {other}: continue from it with resume={other}"
    return "no other checkpoint of the run is readable: start the run again"


def average_checkpoints(paths: Sequence[Path], across_seeds: bool = False) -> dict[str, Any]:
    """The element-wise mean of the model weights of ``paths`` (§6.1), as a checkpoint that loads like them.

    The checkpoints must come from one run: the same weights and shapes, model hyperparameters,
    direction, corpus and tokenizer, and the same seed unless ``across_seeds``. The result keeps the
    config, tokenizer and hyperparameters of the one with the highest global step, drops the optimizer
    and loop state, and lists its sources under ``averaged_from``.
    """
    if not paths:
        raise CheckpointError("no checkpoints to average")
    if len(set(map(Path.resolve, map(Path, paths)))) != len(paths):
        raise CheckpointError("a checkpoint is listed twice; each one may count only once in the average")
    total: dict[str, torch.Tensor] = {}
    sources = []
    newest: dict[str, Any] = {}
    first: dict[str, Any] = {}
    for path in paths:
        checkpoint = load_checkpoint(path)
        weights = checkpoint.get("state_dict")
        if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
            raise CheckpointError(f"checkpoint {path} has no state_dict of tensors")
        step = checkpoint.get("global_step") or 0
        if not whole(step, 0):
            raise CheckpointError(f"checkpoint {path}: global_step={step!r:.40} is not a whole number of steps")
        if not first:
            first = checkpoint
        else:
            _check_same_run(first, checkpoint, path, paths[0], across_seeds)
        for name, tensor in weights.items():
            if name in total and tensor.shape != total[name].shape:
                raise CheckpointError(
                    f"checkpoint {path}: {name} has shape {tuple(tensor.shape)}, not "
                    f"{tuple(total[name].shape)} as in {paths[0]}"
                )
            if tensor.is_floating_point():
                total[name] = total.get(name, 0) + tensor.double()  # float64 sums: the mean of N is exact
            else:
                total[name] = tensor  # integer buffers (counters) are not averaged; see below
        sources.append({"path": str(path), "global_step": step})
        if not newest or step >= (newest.get("global_step") or 0):
            newest = checkpoint
    result = {key: value for key, value in newest.items() if key not in _TRAINING_STATE}
    result["state_dict"] = _mean(total, len(paths), newest["state_dict"])
    result["averaged_from"] = sources
    return result


def run_fields(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What makes two checkpoints parts of one run, for averaging: the model, the direction, the
    corpus with its vocabulary (the name of the data's cache entry), the tokenizer and the seed."""
    run = checkpoint.get(RUN_KEY) if isinstance(checkpoint.get(RUN_KEY), dict) else {}
    config = run.get("config") if isinstance(run.get("config"), dict) else {}
    data = config.get("data") if isinstance(config.get("data"), dict) else {}
    hyper = checkpoint.get("hyper_parameters") if isinstance(checkpoint.get("hyper_parameters"), dict) else {}
    return {
        "model": model_settings(hyper.get("model")),
        "data.src_lang": data.get("src_lang"),
        "data.tgt_lang": data.get("tgt_lang"),
        "corpus": run.get(DATA_KEY),
        "tokenizer": run.get("tokenizer"),
        "seed": config.get("seed"),
    }


def model_settings(model: Any) -> Any:
    """A checkpoint's model hyperparameters, with the fields added since it was written at their defaults
    (the behaviour it was trained with: ``activation_dropout`` 0), so that a run resumed across an upgrade
    averages its older checkpoints with its newer ones."""
    if not isinstance(model, dict):
        return model
    defaults = {field.name: field.default for field in fields(TransformerConfig) if field.default is not MISSING}
    return {**defaults, **model}


def _check_same_run(first: dict[str, Any], other: dict[str, Any], path: Path, first_path: Path, seeds: bool) -> None:
    if first["state_dict"].keys() != other["state_dict"].keys():
        raise CheckpointError(f"checkpoint {path} holds other weights than {first_path}; average one run's")
    ours, theirs = run_fields(first), run_fields(other)
    for field in ours:
        if _same(ours[field], theirs[field]) or (field == "seed" and seeds):
            continue
        shown = {"model": "model hyperparameters", "tokenizer": "tokenizer", "corpus": "corpus (data cache entry)"}
        what = shown.get(field) or f"{field}={show(theirs[field])} (not {show(ours[field])})"
        advice = (
            "; pass --across-seeds to average runs that differ only in their seed"
            if field == "seed"
            else "; average one run's checkpoints"
        )
        raise CheckpointError(f"checkpoint {path} is of another run than {first_path}: another {what}{advice}")


def _same(a: Any, b: Any) -> bool:
    """Equality of stored values of any type (tensors among them compare as unequal, not as an error)."""
    try:
        return bool(a == b) and type(a) is type(b)
    except (RuntimeError, TypeError, ValueError):
        return False


def _mean(total: dict[str, torch.Tensor], n: int, newest: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sums / n in each tensor's own dtype (integer buffers: the newest checkpoint's value).

    Names that share one tensor in the newest checkpoint (the tied embedding and output matrices of
    §3.4) share the averaged tensor too, so the file stores it once.
    """
    by_storage: dict[tuple[int, int], torch.Tensor] = {}
    averaged = {}
    for name, tensor in newest.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in by_storage:
            summed = total[name]
            by_storage[key] = (summed / n).to(tensor.dtype) if tensor.is_floating_point() else tensor
        averaged[name] = by_storage[key]
    return averaged


def save_checkpoint(checkpoint: dict[str, Any], path: Path) -> None:
    """Write ``checkpoint`` to ``path`` atomically (:func:`aiayn.files.atomic_write`): a crash while
    saving leaves the previous file whole, and no writer touches another's temporary file."""
    atomic_write(Path(path), lambda file: torch.save(checkpoint, file))


def remove_plain_file(path: Any, folder: Path) -> bool:
    """Delete ``path`` when it is a plain file (not a link, not a folder) directly inside ``folder``,
    named without a protocol or ``..``: never recursively, never through fsspec. Anything else is
    refused and logged. Whether it was deleted."""
    if not directly_inside(path, folder):
        log.warning("refused to delete %r: only plain files directly inside %s are deleted", path, folder)
        return False
    target = Path(os.fspath(path))
    if target.is_symlink() or (target.exists() and not target.is_file()):
        log.warning("refused to delete %s: not a plain file", target)
        return False
    if not target.exists():
        return False
    try:
        target.unlink()
    except OSError as error:
        log.warning("could not delete %s: %s", target, error)
        return False
    return True


def directly_inside(path: Any, folder: Path) -> bool:
    """Whether ``path`` names, after every link is followed, an entry directly inside ``folder``, and
    names it plainly: a local path without a protocol (``local://``, ``s3://``, ``simplecache::``) or ``..``."""
    if not isinstance(path, str | os.PathLike):
        return False
    text = os.fspath(path)
    if not isinstance(text, str) or not text or "\x00" in text or _PROTOCOL.match(text) or "::" in text:
        return False
    if ".." in Path(text).parts:
        return False
    try:
        return Path(text).resolve().parent == Path(folder).resolve()
    except (OSError, RuntimeError):  # a link loop
        return False


def load_model(path: Path, device: str | torch.device = "cpu") -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    """The model (in eval mode), its tokenizer and the run config stored in an aiayn checkpoint."""
    return model_from_checkpoint(load_checkpoint(path), path, device)


def model_from_checkpoint(
    checkpoint: dict[str, Any], path: Path, device: str | torch.device = "cpu"
) -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    """:func:`load_model`'s result from the contents of the checkpoint at ``path`` (read already)."""
    run = run_entry(checkpoint, path)
    hyper = checkpoint.get("hyper_parameters")
    if {"config", "tokenizer"} - set(run) or not isinstance(hyper, dict) or not isinstance(hyper.get("model"), dict):
        raise CheckpointError(
            f"checkpoint {path} was not written by aiayn-train or aiayn-average (no {RUN_KEY!r} "
            "entry with the tokenizer and config, or no hyper_parameters.model)"
        )
    weights = checkpoint.get("state_dict")
    if not isinstance(weights, dict):
        raise CheckpointError(f"checkpoint {path}: state_dict={type(weights).__name__} is not the model's weights")
    prefix = "model."
    weights = {k[len(prefix) :]: v for k, v in weights.items() if isinstance(k, str) and k.startswith(prefix)}
    try:  # a shared file: a field the model does not have, a value it cannot take, weights of another shape
        cfg = TransformerConfig(**{str(key): value for key, value in hyper["model"].items()})
        check_weights(cfg, weights)  # before the model is built: its stored size may be anything
        tokenizer = Tokenizer.from_bytes(run["tokenizer"])
        if tokenizer.vocab_size != cfg.vocab_size:
            raise FieldError("vocab_size", cfg.vocab_size, f"is not its tokenizer's {tokenizer.vocab_size} pieces")
        model = Transformer(cfg)
        model.load_state_dict(weights)
    except (TypeError, ValueError, KeyError, RuntimeError, AttributeError, ArithmeticError) as error:
        raise CheckpointError(
            f"checkpoint {path}: hyper_parameters.model holds a model aiayn cannot build: {first_line(error)}"
        ) from None
    return model.to(device).eval(), tokenizer, run["config"]
