"""Which checkpoint a run continues from, and whether it may: a resume continues the training the
checkpoint holds, or it is refused before any work.

What a resumed run cannot honour is checked against the config stored in the checkpoint: the model,
the data (the corpus's content and the tokenizer, through the name of its cache entry; the limits and
sizes the sampler's position depends on), the seed (the random state comes from the checkpoint) and the
batching (devices, nodes, tokens per step). A difference is refused with both values. What it can
honour (the schedule, Adam's settings, the run's length, validation, logging) is applied and logged;
the module puts the new ``optim.*`` values into the restored state
(:meth:`~aiayn.training.module.TranslationModule.on_load_checkpoint`).

The folder of a multirun's job or a sweep's trial, run again, continues by itself only the run of the
same overrides: job 0 of ``-m optim.warmup=1000,2000`` is not continued by job 0 of ``-m
optim.warmup=3000,4000``. A plain run continues its folder with changed settings that it can honour.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pytorch_lightning.utilities.rank_zero import rank_zero_only

from aiayn.config.build import RUN_FLAGS
from aiayn.config.naming import NOT_IN_RUN_NAMES, defining_overrides
from aiayn.errors import CheckpointError, ConfigError, show, whole
from aiayn.files import own_folder, same_file
from aiayn.training.checkpoints import (
    BATCH_KEY,
    DATA_KEY,
    OVERRIDES_KEY,
    STEP_FILE,
    check_resumable,
    load_checkpoint,
    run_entry,
    step_checkpoints,
)
from aiayn.training.metrics import METRICS_CSV, drop_metrics_from

log = logging.getLogger(__name__)
BATCH_WORDS = {"world_size": "training processes", "accumulation": "batches per optimizer step"}

# Settings that say where a run reads, how fast and how it reports, not what it computes.
NOT_COMPARED = (*NOT_IN_RUN_NAMES, "name", "tags", *(f"model.{key}" for key in RUN_FLAGS), "data.pin_memory")
# Settings a resumed run cannot honour: the checkpoint's weights, random state and position in the
# epoch were made with the stored values.
FIXED = ("model.", "data.", "seed", "tokens_per_step", "trainer.devices", "trainer.num_nodes",
         "trainer.accumulate_grad_batches")  # fmt: skip


def resume_from(
    requested: bool | str | None,
    run_dir: Path,
    config: Mapping[str, Any],
    data_cache: Path,
    batch: Mapping[str, int],
    own_overrides: Sequence[str] | None = None,
) -> Path | None:
    """The checkpoint to continue from, checked: ``requested`` when it is a path; else the run folder's own
    ``last.ckpt`` (``resume=true`` chose the folder of the latest idle run; a requeued job or a trial run
    again continues its folder by itself), which ``resume=true`` requires. ``resume=false`` starts afresh,
    which a folder that holds a run refuses. ``config`` is this run's resolved config and ``data_cache``
    its data's cache entry (its name, and its tokenizer's bytes, are compared with the checkpoint's),
    ``batch`` its :func:`~aiayn.training.batching.batch_layout`. A
    job of a multirun or a sweep gives its ``own_overrides``: its folder continues by itself only the run
    of those."""
    path = requested_checkpoint(requested, run_dir)
    if path is None:
        continue_at(run_dir, None, 0)
        return None
    stored = check_resumable(path)
    run = run_entry(stored, path)
    if requested is None and own_overrides is not None:
        check_own_overrides(path, run.get(OVERRIDES_KEY), own_overrides)
    check_same_training(path, run.get("config") or {}, config, run.get(DATA_KEY), data_cache.name)
    spm = data_cache / "spm.model"  # read only when a checkpoint is continued
    if spm.is_file() and run.get("tokenizer") not in (None, spm.read_bytes()):
        raise CheckpointError(
            f"checkpoint {path} holds another tokenizer than this run's data cache {data_cache.name}: its ids mean "
            "other pieces, so a resumed run cannot use them; resume on the data it was trained on or start a new run"
        )
    check_same_batches(path, run.get(BATCH_KEY), batch)
    continue_at(run_dir, path, stored.get("global_step", 0))
    return path


def requested_checkpoint(requested: bool | str | None, run_dir: Path) -> Path | None:
    """The checkpoint ``resume=`` names, or the folder's own ``last.ckpt``, or None (a fresh start)."""
    last = run_dir / "checkpoints" / "last.ckpt"
    if requested is False:
        if last.is_file():
            raise ConfigError(
                "resume", False, f"but {run_dir} holds a run (checkpoints/last.ckpt): continue it with "
                "resume=true or start this one in another folder"
            )  # fmt: skip
        return None
    if isinstance(requested, str):
        path = Path(requested).expanduser()
        if not path.is_file():
            raise ConfigError(
                "resume", requested, "is not a file; give a checkpoint such as <run>/checkpoints/last.ckpt"
            )
        return path
    if last.is_file():
        return last
    if requested is True:
        raise ConfigError(
            "resume", True, f"found no earlier run with checkpoints/last.ckpt in {run_dir.parent} that no living "
            "process is writing"
        )  # fmt: skip
    return None


def continue_at(run_dir: Path, resumed: Path | None, step: int) -> None:
    """Make the folder hold nothing of a part of the run after ``step`` (0: a fresh start): newer
    checkpoints are set aside, later metric rows dropped (they are logged again). A part killed while
    it wrote its first checkpoint leaves rows and no checkpoint. Done by the folder's one writer."""
    if rank_zero_only.rank != 0:
        return
    if resumed is not None:
        set_aside_newer(run_dir / "checkpoints", resumed, step)
    if dropped := drop_metrics_from(run_dir / METRICS_CSV, step):
        log.info("continuing at step %d: dropped %d metric rows logged after it (logged again)", step, dropped)


def check_own_overrides(path: Path, stored: Sequence[str] | None, overrides: Sequence[str]) -> None:
    """A folder that continues by itself continues the run of the same overrides, not another one."""
    if stored is None:
        return
    theirs, ours = set(defining_overrides(stored)), set(defining_overrides(overrides))
    if theirs != ours:
        raise CheckpointError(
            f"{path.parents[1]} holds the run of {' '.join(sorted(theirs - ours)) or 'fewer overrides'}, this "
            f"one is of {' '.join(sorted(ours - theirs)) or 'fewer overrides'}: a run folder continues only its "
            "own run; start this one in "
            "another folder (hydra.sweep.dir=... for a multirun), or add resume=true to continue it with these"
        )


def check_same_training(
    path: Path, stored: Mapping[str, Any], config: Mapping[str, Any], stored_data: str | None, data_cache: str
) -> None:
    """Refuse what the resumed run cannot honour; log what it applies."""
    before, now = dict(flattened(stored)), dict(flattened(config))
    changed = [key for key in sorted(set(before) | set(now)) if before.get(key, "<unset>") != now.get(key, "<unset>")]
    changed = [key for key in changed if not key.startswith(NOT_COMPARED)]
    fixed = [key for key in changed if key.startswith(FIXED)]  # set in either config: +trainer.num_nodes=2
    if fixed:
        key = min(fixed, key=lambda k: (k.count("."), k))  # seed, not data.seed that follows it
        was, now_shown = _shown(before.get(key)), _shown(now.get(key))
        raise CheckpointError(
            f"checkpoint {path} was trained with {key}={was}, this run has {key}={now_shown}: a resumed run "
            f"cannot change it; resume with {key}={was} or start a new run"
        )
    if stored_data is not None and stored_data != data_cache:
        raise CheckpointError(
            f"checkpoint {path} was trained on the data of cache entry {stored_data}, this run's is {data_cache} "
            "(another corpus content, tokenizer or vocabulary): a resumed run cannot change its data"
        )
    if changed and rank_zero_only.rank == 0:
        applied = ", ".join(f"{key}={_shown(before.get(key))} → {_shown(now.get(key))}" for key in changed)
        log.warning("resuming %s with this run's settings, not the checkpoint's: %s", path, applied)


def check_same_batches(path: Path, stored: Mapping[str, int] | None, batch: Mapping[str, int]) -> None:
    """The processes and accumulated batches per step as the checkpoint's (``trainer.devices=auto`` on
    another machine is equal as a setting, not as a batch)."""
    for key, value in (stored or {}).items():
        if batch.get(key) != value:
            raise CheckpointError(
                f"checkpoint {path} was trained with {key}={value} ({BATCH_WORDS[key]}), this run has "
                f"{key}={batch.get(key)}: a resumed run cannot change its batches; resume on {value} "
                "processes with the same accumulation, or start a new run"
            )


def _shown(value: Any) -> str:
    """A stored value in a message: as typed on the command line, on one short line."""
    text = show(value).replace("\n", "\\n")
    return text if len(text) <= 80 else text[:77] + "..."


def flattened(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` for every leaf of a nested mapping; lists are leaves."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from flattened(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), node


def set_aside_newer(folder: Path, resumed: Path, step: int) -> None:
    """Move the checkpoints of ``folder`` newer than ``step`` (an abandoned continuation of the resumed
    one) into ``folder/abandoned-after-step<step>/``, so that no later average, resume or evaluation of
    the best takes them; a ``best.ckpt`` set aside is written again when the run betters the best score
    it resumed with, else the run's best is its ``last.ckpt``."""
    if not folder.is_dir():
        return
    newer = [
        path
        for path in [*step_checkpoints(folder), folder / "last.ckpt", folder / "best.ckpt"]
        if path.is_file() and not same_file(path, resumed) and _step(path) > step
    ]
    if not newer:
        return
    aside = own_folder(folder / f"abandoned-after-step{step}")
    for path in newer:
        os.replace(path, aside / path.name)  # a rename within checkpoints/: never a copy elsewhere
    log.warning("resuming at step %d: moved %d newer checkpoints to %s", step, len(newer), aside)


def _step(path: Path) -> float:
    """A checkpoint's global step: from a step checkpoint's name, else from the file; an unreadable
    file (the truncated ``last.ckpt`` a resume from an older one goes around) counts as newer."""
    if found := STEP_FILE.fullmatch(path.name):
        return int(found.group(1))
    try:
        step = load_checkpoint(path, mmap=True).get("global_step", 0)
    except CheckpointError:
        return math.inf
    return step if whole(step, 0) else math.inf  # a foreign value: set aside, as an unreadable file is
