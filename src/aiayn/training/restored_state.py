"""What a checkpoint may restore into a run, checked before Lightning applies any of it.

Loaded with ``weights_only=True`` a checkpoint runs no code, but its plain data still steers what
Lightning does next: a ``ModelCheckpoint`` state names the files its tracker deletes when a better one
comes, loop counters pick the batches, optimizer groups pick the update rule, a version string picks
the migrations. People share checkpoints, so every part that reaches Lightning is checked here against
what aiayn itself writes:

- the weights, the optimizer and the schedule (:mod:`~aiayn.training.restored_optimization`) against
  this run's own module and optimizer (names, shapes, group sizes, Adam's switches);
- the loop counters against the trainer's own loops (the same keys, whole numbers in range);
- the callback states: aiayn's callbacks each check their own (:class:`~aiayn.training.saved_state.CheckedState`),
  others must be plain data, and the checkpoint trackers' paths are checked against the run's own
  ``checkpoints/`` folder: a tracker that names anything else is dropped, and so
  is every tracker of a checkpoint from another folder (it continues weights, optimizer moments,
  schedule position, data position and random state, never another folder's bookkeeping).

A part that is not aiayn's shape ends the run in one line (:class:`~aiayn.errors.CheckpointError`
naming the file and the field); a tracker that points elsewhere is dropped with a warning.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from packaging.version import InvalidVersion, Version
from pytorch_lightning.callbacks import ModelCheckpoint, Timer
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from aiayn.errors import is_number, whole
from aiayn.files import same_file
from aiayn.training.checkpoints import RUN_KEY, STEP_FILE, STEP_NAME, directly_inside, remove_plain_file
from aiayn.training.restored_optimization import check_optimization, check_scaler
from aiayn.training.saved_state import COUNT_LIMIT, CheckedState, Fields, shape_of, short

log = logging.getLogger(__name__)

# The top-level entries aiayn-train and aiayn-average write; anything else reaches user hooks unchecked.
TOP_LEVEL = (
    "epoch",
    "global_step",
    "pytorch-lightning_version",
    "state_dict",
    "loops",
    "callbacks",
    "optimizer_states",
    "lr_schedulers",
    "hparams_name",
    "hyper_parameters",
    RUN_KEY,
    "averaged_from",
    "MixedPrecision",
)
TRACKER_PATHS = ("best_model_path", "kth_best_model_path", "last_model_path")
TRACKER_KEYS = ("monitor", "best_model_score", "current_score", "dirpath", "best_k_models", "kth_value", *TRACKER_PATHS)


class RestoredState:
    """The check of every checkpoint a run's trainer loads: ``folder`` is the run's ``checkpoints/``
    folder, ``module`` the run's :class:`~aiayn.training.module.TranslationModule` (attached to its
    trainer by the time Lightning loads a checkpoint)."""

    def __init__(self, folder: Path, module: pl.LightningModule) -> None:
        self.folder, self.module = Path(folder), module

    def __call__(self, checkpoint: dict[str, Any], path: Path) -> dict[str, Any]:
        """``checkpoint`` (loaded from ``path``) as it may be restored: checked, foreign parts dropped."""
        field = Fields(path)
        for key in [key for key in checkpoint if key not in TOP_LEVEL]:
            log.warning("checkpoint %s: ignored its entry %r, which aiayn does not write", path, key)
            del checkpoint[key]
        version = checkpoint.get("pytorch-lightning_version")
        try:  # Lightning migrates by this version: a foreign one would run migrations on foreign data
            if not isinstance(version, str) or Version(version) < Version("2.0"):
                raise InvalidVersion(version)
        except InvalidVersion:
            raise field.error("pytorch-lightning_version", version, "is not a Lightning 2 version") from None
        for key in ("epoch", "global_step"):
            field.count(key, checkpoint.get(key, 0))
        self._check_weights(checkpoint, field)
        if "loops" in checkpoint:
            _check_loops(checkpoint["loops"], self.trainer, field)
        if "optimizer_states" in checkpoint or "lr_schedulers" in checkpoint:
            check_optimization(checkpoint, field, self.module)
        if "callbacks" in checkpoint:
            checkpoint["callbacks"] = self._checked_callbacks(checkpoint["callbacks"], path, field)
        if "MixedPrecision" in checkpoint:
            check_scaler(checkpoint["MixedPrecision"], field)
        return checkpoint

    @property
    def trainer(self) -> pl.Trainer:
        return self.module.trainer

    # -- weights -------------------------------------------------------------
    def _check_weights(self, checkpoint: dict[str, Any], field: Fields) -> None:
        weights = field.mapping("state_dict", checkpoint.get("state_dict"))
        own = self.module.state_dict()
        for name in sorted(set(own) ^ set(weights), key=str):
            raise field.error(
                f"state_dict[{name!r}]",
                "present" if name in weights else "missing",
                "differs from this run's model (another model or not an aiayn checkpoint)",
            )
        for name, tensor in weights.items():
            if not isinstance(tensor, torch.Tensor) or tensor.shape != own[name].shape:
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise field.error(f"state_dict[{name!r}]", shape, f"is not this run's shape {tuple(own[name].shape)}")

    # -- callbacks ------------------------------------------------------------------------------
    def _checked_callbacks(self, states: Any, path: Path, field: Fields) -> dict[str, Any]:
        states = field.mapping("callbacks", states)
        live = {callback.state_key: callback for callback in self.trainer.callbacks}
        own_folder = directly_inside(path, self.folder)
        kept: dict[str, Any] = {}
        for key, state in states.items():
            callback = live.get(key)
            name = f"callbacks[{key!r}]"
            if callback is None:
                log.warning("checkpoint %s: ignored the state of %s, not a callback of this run", path, short(key))
            elif isinstance(callback, ModelCheckpoint):
                if not own_folder:
                    log.warning(
                        "checkpoint %s lies outside this run's %s: its checkpoint tracker %s starts afresh here",
                        path,
                        self.folder,
                        callback.monitor,
                    )
                elif (tracker := self._checked_tracker(state, callback, name, path, field)) is not None:
                    kept[key] = tracker
            else:
                kept[key] = self._checked_callback_state(callback, state, name, path, field)
                if kept[key] is None:
                    del kept[key]
        return kept

    def _checked_tracker(
        self, state: Any, callback: ModelCheckpoint, name: str, path: Path, field: Fields
    ) -> dict[str, Any] | None:
        """A ``ModelCheckpoint`` state whose every path is a file directly in this run's folder, its
        scores numbers; trimmed to this run's ``save_top_k`` (``checkpoint.keep_last`` may have
        shrunk: the files of the dropped entries are deleted, or they would pile up untracked)."""
        state = field.mapping(name, state)
        # Lightning reads best_model_score and best_model_path without a default: both must be there.
        odd = set(state) - set(TRACKER_KEYS) or {"best_model_score", "best_model_path"} - set(state)
        if odd or state.get("monitor") != callback.monitor:
            log.warning("checkpoint %s: dropped %s, not a tracker aiayn writes", path, name)
            return None
        paths = [(key, state.get(key, "")) for key in TRACKER_PATHS]
        scores = field.mapping(f"{name}.best_k_models", state.get("best_k_models", {}))
        paths += [("best_k_models", key) for key in scores]
        if "dirpath" in state and not (
            isinstance(state["dirpath"], str) and _same_folder(state["dirpath"], self.folder)
        ):
            log.warning(
                "checkpoint %s: dropped %s, whose dirpath %s is not %s",
                path,
                name,
                short(state["dirpath"]),
                self.folder,
            )
            return None
        own = _written_by(callback)
        for key, value in paths:
            if value != "" and not (isinstance(value, str) and directly_inside(value, self.folder)):
                log.warning(
                    "checkpoint %s: dropped %s, whose %s %s is not a file of %s",
                    path,
                    name,
                    key,
                    short(value),
                    self.folder,
                )
                return None
            if value != "" and not own.fullmatch(Path(value).name):  # it would delete best.ckpt, an average
                log.warning(
                    "checkpoint %s: dropped %s, whose %s %s is not a file this tracker writes",
                    path,
                    name,
                    key,
                    short(value),
                )
                return None
        for key in ("best_model_score", "current_score", "kth_value"):
            _score(field, f"{name}.{key}", state.get(key))
        for key, score in scores.items():
            _score(field, f"{name}.best_k_models[{key!r}]", score, allow_none=False)
        fitting = self.trainer.state.fn == TrainerFn.FITTING  # a test of best.ckpt does not prune
        return _trimmed(state, scores, callback, path, self.folder) if fitting else state

    def _checked_callback_state(
        self, callback: pl.Callback, state: Any, name: str, path: Path, field: Fields
    ) -> dict[str, Any] | None:
        if isinstance(callback, CheckedState):  # aiayn's callbacks check what they save themselves
            return callback.checked_state(state, field, name, self.trainer, self.module)
        if isinstance(callback, Timer):  # trainer.max_time: a negative or foreign offset would move the limit
            elapsed = field.mapping(f"{name}.time_elapsed", field.mapping(name, state).get("time_elapsed", {}))
            for stage, seconds in elapsed.items():
                field.number(f"{name}.time_elapsed[{stage!r}]", seconds, minimum=0)
        elif not _plain(state):
            log.warning("checkpoint %s: dropped %s, which holds paths or objects aiayn does not write", path, name)
            return None
        return state


def _check_loops(loops: Any, trainer: pl.Trainer, field: Fields) -> None:
    """The loops' progress: the keys this trainer's loops have, whole numbers (flags: booleans); the
    loader's position (``combined_loader``) as the sampler saves it. Extra entries are dropped."""
    own = {
        name: getattr(trainer, name).state_dict() for name in ("fit_loop", "validate_loop", "test_loop", "predict_loop")
    }
    _check_like(field.mapping("loops", loops), own, "loops", field)
    fit_state = loops["fit_loop"]["state_dict"]
    if "combined_loader" in fit_state:  # saved by the training loader (aiayn.data.sampler)
        loaders = field.sequence("loops.fit_loop.state_dict.combined_loader", fit_state["combined_loader"], length=1)
        for i, loader in enumerate(loaders):
            name = f"loops.fit_loop.state_dict.combined_loader[{i}]"
            loader = field.mapping(name, loader)
            for key in ("epoch", "position", "consumed"):
                if key not in loader:
                    raise field.error(f"{name}.{key}", "missing", "is in every position the sampler saves")
            for key, value in loader.items():
                if not isinstance(key, str) or not whole(value, 0) or value >= COUNT_LIMIT:
                    raise field.error(f"{name}.{short(key)}", value, f"is not a whole number in [0, {COUNT_LIMIT})")


def _check_like(value: Any, own: Any, name: str, field: Fields) -> None:
    if isinstance(own, dict):
        value = field.mapping(name, value)
        for key in own.keys() - value.keys():
            raise field.error(f"{name}.{key}", "missing", "is in every checkpoint of this Lightning version")
        for key in [key for key in value if key not in own and key != "combined_loader"]:
            del value[key]
        for key, entry in own.items():
            _check_like(value[key], entry, f"{name}.{key}", field)
    elif isinstance(own, bool):
        if not isinstance(value, bool):
            raise field.error(name, value, "is not true or false")
    elif isinstance(own, int):
        field.count(name, value)


def _score(field: Fields, name: str, value: Any, allow_none: bool = True) -> None:
    """A tracker's score: one number, not NaN (±inf is a tracker's start, before any score)."""
    if value is None and allow_none:
        return
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.isnan().any():
        return
    if is_number(value) or (isinstance(value, float) and not math.isnan(value)):  # 10**400 is no score
        return
    raise field.error(name, shape_of(value) if isinstance(value, torch.Tensor) else value, "is not a score")


def _written_by(callback: ModelCheckpoint) -> re.Pattern[str]:
    """The names of the files ``callback`` writes, and so the only ones its state may name (Lightning
    deletes what a tracker's state names): ``step<N>.ckpt``, or ``<filename>.ckpt`` (``best.ckpt``)."""
    if callback.filename == STEP_NAME:
        return STEP_FILE
    return re.compile(re.escape(f"{callback.filename}{callback.FILE_EXTENSION}"))


def _trimmed(
    state: dict[str, Any], scores: dict[str, Any], callback: ModelCheckpoint, path: Path, folder: Path
) -> dict[str, Any]:
    """``state`` ranked again for this run's ``save_top_k`` and ``mode``: the entries beyond it dropped
    (their step checkpoints deleted), and the worst kept one as Lightning's "k-th", which it displaces
    (and looks up) once the tracker holds ``save_top_k`` files. Whatever the stored run kept, a count
    equal to this run's has its k-th, so the next save replaces a file the tracker holds."""
    keep = callback.save_top_k
    ranked = sorted(scores, key=lambda name: float(scores[name]), reverse=callback.mode == "max")
    if keep > 0 and len(ranked) >= keep:
        state["kth_best_model_path"], state["kth_value"] = ranked[keep - 1], scores[ranked[keep - 1]]
    if keep < 0 or len(scores) <= keep:
        return state
    kept, dropped = ranked[:keep], ranked[keep:]
    state["best_k_models"] = {name: scores[name] for name in kept}
    if rank_zero_only.rank == 0:
        for name in dropped:  # only step checkpoints are pruned; never the one resumed from
            if STEP_FILE.fullmatch(Path(name).name) and not same_file(name, path):
                remove_plain_file(name, folder)
        log.warning(
            "checkpoint %s kept %d checkpoints by %s, this run keeps %d: removed %s",
            path,
            len(scores),
            callback.monitor,
            keep,
            ", ".join(Path(name).name for name in dropped),
        )
    return state


def _plain(value: Any, depth: int = 0) -> bool:
    """Only numbers, flags, tensors and short words: no paths, no protocols, no deep nesting."""
    if depth > 8:
        return False
    if isinstance(value, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, str):
        return len(value) <= 200 and not re.search(r"[/\\:]|\.\.", value)
    return value is None or isinstance(value, bool | int | float | torch.Tensor)


def _same_folder(path: str, folder: Path) -> bool:
    """Whether ``path`` names ``folder`` itself, plainly (see :func:`directly_inside`)."""
    return directly_inside(Path(path) / "x", folder) if path else False
