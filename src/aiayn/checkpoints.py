"""Checkpoints of a run: the newest ones, their average (§6.1), and loading one for translation.

Every checkpoint that ``aiayn-train`` writes carries, under :data:`RUN_KEY`, the run's resolved config
and the sentencepiece model, so that a single ``.ckpt`` file is enough to translate or evaluate.
Periodic checkpoints are named ``step<global step>.ckpt``.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from aiayn.data.tokenizer import Tokenizer
from aiayn.model import Transformer, TransformerConfig

RUN_KEY = "aiayn"  # {"config": resolved run config, "tokenizer": serialized sentencepiece model}
STEP_NAME = "step{step:07d}"  # ModelCheckpoint filename template of the periodic checkpoints
_STEP_FILE = re.compile(r"^step(\d+)\.ckpt$")
# Training state that an averaged checkpoint does not carry: it is for evaluation, not for resuming.
_TRAINING_STATE = ("optimizer_states", "lr_schedulers", "loops", "callbacks", "MixedPrecision")


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or does not fit the others."""


def step_checkpoints(run: Path) -> list[Path]:
    """The periodic checkpoints of a run folder (or of its ``checkpoints/`` folder), oldest first."""
    folder = run / "checkpoints" if (run / "checkpoints").is_dir() else run
    if not folder.is_dir():
        raise CheckpointError(f"{run} is not a folder; give a run folder or its checkpoints/ folder")
    found = [(int(m.group(1)), path) for path in folder.iterdir() if (m := _STEP_FILE.match(path.name))]
    return [path for _, path in sorted(found)]


def load_checkpoint(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # torch raises several types for truncated or foreign files
        raise CheckpointError(f"checkpoint {path} cannot be read: {error}") from error


def average_checkpoints(paths: Sequence[Path]) -> dict[str, Any]:
    """The element-wise mean of the model weights of ``paths`` (§6.1), as a checkpoint that loads like them.

    The result keeps the newest checkpoint's config, tokenizer and hyperparameters, drops the
    optimizer and loop state, and lists its sources under ``averaged_from``.
    """
    if not paths:
        raise CheckpointError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    sources = []
    newest: dict[str, Any] = {}
    for path in paths:
        checkpoint = load_checkpoint(path)
        weights = checkpoint.get("state_dict")
        if weights is None:
            raise CheckpointError(f"checkpoint {path} has no state_dict")
        if total and weights.keys() != total.keys():
            raise CheckpointError(f"checkpoint {path} holds other weights than {paths[0]}; average one run's")
        for name, tensor in weights.items():
            if name in total and tensor.shape != total[name].shape:
                raise CheckpointError(
                    f"checkpoint {path}: {name} has shape {tuple(tensor.shape)}, not "
                    f"{tuple(total[name].shape)} as in {paths[0]}"
                )
            if tensor.is_floating_point():
                total[name] = total.get(name, 0) + tensor.double()  # float64 sums: the mean of N is exact
            else:
                total[name] = tensor  # integer buffers (counters) are not averaged; the newest is kept
        sources.append({"path": str(path), "global_step": checkpoint.get("global_step")})
        newest = checkpoint
    averaged = {
        name: (tensor / len(paths)).to(newest["state_dict"][name].dtype) if tensor.is_floating_point() else tensor
        for name, tensor in total.items()
    }
    result = {key: value for key, value in newest.items() if key not in _TRAINING_STATE}
    result["state_dict"] = averaged
    result["averaged_from"] = sources
    return result


def save_checkpoint(checkpoint: dict[str, Any], path: Path) -> None:
    """Write ``checkpoint`` to ``path`` atomically: readers never see a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        torch.save(checkpoint, tmp)
    os.replace(tmp.name, path)


def load_model(path: Path, device: str | torch.device = "cpu") -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    """The model (in eval mode), its tokenizer and the run config stored in an aiayn checkpoint."""
    checkpoint = load_checkpoint(path)
    run = checkpoint.get(RUN_KEY)
    if run is None or "hyper_parameters" not in checkpoint:
        raise CheckpointError(
            f"checkpoint {path} was not written by aiayn-train or aiayn-average (no {RUN_KEY!r} "
            "entry with the tokenizer and config)"
        )
    model = Transformer(TransformerConfig(**checkpoint["hyper_parameters"]["model"]))
    prefix = "model."
    model.load_state_dict({k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)})
    return model.to(device).eval(), Tokenizer.from_bytes(run["tokenizer"]), run["config"]
