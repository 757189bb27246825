"""How a run is named and where it is written: its folder, its name and group on the dashboard.

Hydra chooses a run's folder while it composes the config (``hydra.run.dir`` in conf/train.yaml calls
:func:`run_dir` through the ``aiayn.run_dir`` resolver; ``hydra.sweep.dir`` and ``hydra.sweep.subdir`` of a
multirun :func:`multirun_dir` and :func:`job_dir`), so the naming sits in the config layer, and the sweeps
and reports above it name their trials and group their runs with the same functions.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hydra.types import RunMode

from aiayn.errors import DataError
from aiayn.files import hold_run_folder, read_plain_file, run_folder_holder
from aiayn.machine import process_rank

SWEEP_DIR_ENV = "AIAYN_SWEEP_DIR"  # set by aiayn-sweep for its trials: the sweep's folder ...
RUN_DIR_ENV = "AIAYN_RUN_DIR"  # ... and the trial's own folder in it
TORCHRUN_KEY = "aiayn/run_dir"  # the run folder's name in torchrun's store (torchrun_folder)
OUTPUT_ENV = "AIAYN_OUTPUT"  # where runs, multiruns and sweeps are written (cluster scratch); default outputs/
# Overrides that say where a run reads and writes, or how it reports, not what it trains.
NOT_IN_RUN_NAMES = (
    "data.root", "data.cache_dir", "data.num_workers", "data.prefetch_factor", "data.encode_workers", "hydra.",
    "logger", "progress", "dashboard.", "peak_tflops", "callbacks", "resume", "max_nonfinite_steps", "hardware",
    "sweep_dir", "paths.", "gc_every", "sdpa_backends", "micro_batch_cap",
)  # fmt: skip
MAX_LABEL_BYTES = 200  # file names may hold 255 bytes
PARAMS_BYTES = 1 << 20  # a trial's parameters, as aiayn-sweep and wandb agent write them: a few lines


def output_root() -> str:
    """The folder every run, multirun and sweep folder goes in: ``$AIAYN_OUTPUT``, else ``outputs``
    (relative to the working folder). aiayn-train's ``paths.output_dir`` defaults to it."""
    return os.environ.get(OUTPUT_ENV) or "outputs"


def experiment_name(experiment: str | None, model: str, data: str) -> str:
    """The name of a run (its folder under ``outputs/``, its dashboard name): the experiment's path with
    ``/`` as ``_`` (``experiment=table3/A1`` is ``table3_A1``), else ``<model>_<data>``. An experiment
    file may set ``name:`` itself; a copied file that does not still gets a name of its own."""
    return experiment.replace("/", "_") if experiment else f"{model}_{data}"


@dataclass(frozen=True)
class RunIdentity:
    """How a run is named and grouped on the dashboard."""

    name: str
    group: str


def defining_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides that change what a run trains: not where it reads and writes, nor how it reports."""
    kept = []
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key in ("name", "tags") or key.startswith(NOT_IN_RUN_NAMES):
            continue
        kept.append(override)
    return kept


def run_identity(experiment: str, overrides: Sequence[str], group: str | None = None) -> RunIdentity:
    """Name a run after its experiment and the overrides that change what it trains; group it by
    ``group`` (a Hydra multirun's or a sweep's, so that their runs sit together even when they vary the
    experiment or the model), else by experiment."""
    kept = [override for override in defining_overrides(overrides) if not override.startswith("experiment=")]
    return RunIdentity(name=" ".join([experiment, *kept]), group=group or experiment)


def run_label(overrides: Sequence[str]) -> str:
    """A folder name for a sweep's trial: ``overrides`` joined by commas (``experiment=mini_A1,seed=2``);
    path separators become ``_``, and a label too long for a file name keeps its start and gains a hash
    of the whole."""
    label = ",".join(overrides).replace(os.sep, "_") or "defaults"
    if len(label.encode()) > MAX_LABEL_BYTES:
        digest = hashlib.sha1(label.encode()).hexdigest()[:10]
        label = label.encode()[: MAX_LABEL_BYTES - 11].decode(errors="ignore") + "-" + digest
    return label


def sweep_dir(root: str | None = None) -> str | None:
    """The folder of the sweep this process is a trial of: ``$AIAYN_SWEEP_DIR`` (aiayn-sweep), else
    ``<root>/sweeps/<sweep id>`` under ``wandb agent`` (which sets ``WANDB_SWEEP_ID``; ``root`` defaults
    to :func:`output_root`), else None."""
    if os.environ.get(SWEEP_DIR_ENV):
        return os.environ[SWEEP_DIR_ENV]
    if os.environ.get("WANDB_SWEEP_ID"):
        return str(Path(root or output_root()) / "sweeps" / os.environ["WANDB_SWEEP_ID"])
    return None


def sweep_parameters() -> set[str] | None:
    """The parameters a sweep sets for this trial: the keys of the file ``wandb agent`` names in
    ``$WANDB_SWEEP_PARAM_PATH``; None outside a sweep or when it is unreadable (not a plain file, more than
    :data:`PARAMS_BYTES`, not YAML)."""
    path = os.environ.get("WANDB_SWEEP_PARAM_PATH")
    try:
        params = yaml.safe_load(read_plain_file(Path(path), PARAMS_BYTES)) if path else None
    except (DataError, OSError, yaml.YAMLError, RecursionError):
        return None
    return set(params) if isinstance(params, dict) else None


def run_dir(root: str, name: str, sweep: str | None, overrides: Sequence[str], now: str, resume: Any = None) -> str:
    """A run's folder: the one aiayn-sweep chose for its trial (``$AIAYN_RUN_DIR``: a trial run again
    continues there from its last checkpoint); under ``wandb agent``, ``<sweep>/<the overrides the sweep
    sets>-<W&B run id>`` (random and bayes may propose one setting twice); with ``resume=true``, the
    latest earlier run of ``name`` that has a last checkpoint (:func:`latest_run`); else
    ``<root>/<name>/<start time>`` (``root``: ``paths.output_dir``), created here so that no other run
    takes it: a run started in the same second (another seed of a grid started by a script) gets
    ``<start time>-2``. The ranks that ``torchrun`` or ``srun`` starts each resolve this: they agree on
    one folder (:func:`torchrun_folder`, :func:`slurm_step`)."""
    if os.environ.get(RUN_DIR_ENV):
        return os.environ[RUN_DIR_ENV]
    if sweep:
        swept = sweep_parameters()
        chosen = [o for o in overrides if o.split("=", 1)[0] in swept] if swept else defining_overrides(overrides)
        run_id = os.environ.get("WANDB_RUN_ID")
        return str(Path(sweep) / (run_label(chosen) + (f"-{run_id}" if run_id else "")))
    runs = Path(root) / name
    if resume is True and (latest := latest_run(runs)):
        return str(latest)
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None:
        return str(torchrun_folder(runs, now))
    if (slurm := slurm_step()) is not None:
        folder = runs / slurm
        folder.mkdir(parents=True, exist_ok=True)  # by whichever rank comes first
        return str(folder)
    return str(reserved_folder(runs, now))


def torchrun_folder(runs: Path, now: str) -> Path:
    """The folder of a run whose ranks ``torchrun`` started, agreed by all of them: the first rank
    reserves it (:func:`reserved_folder`) and leaves its name in the store torchrun's agent serves to
    its workers (at ``MASTER_ADDR:MASTER_PORT``), where the other ranks wait for it. Each rank's own
    clock would name another second, and a rank that made that folder first would push the first one
    to ``<time>-2``. A restart of the workers (``--max-restarts``) finds the name there and continues
    the same folder from its last checkpoint."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise DataError(
            "torchrun started this run without its agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), which "
            "its ranks need to agree on one run folder: unset it, or name the folder with hydra.run.dir=..."
        )
    store = TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(minutes=5)
    )
    if process_rank() == 0:
        if store.check([TORCHRUN_KEY]):  # a restart: the folder its first attempt reserved
            return Path(store.get(TORCHRUN_KEY).decode())
        folder = reserved_folder(runs, now)
        store.set(TORCHRUN_KEY, str(folder))
        return folder
    return Path(store.get(TORCHRUN_KEY).decode())  # waits for the first rank


def slurm_step() -> str | None:
    """``slurm-<job>.<step>`` for a process of an ``srun`` step of several tasks (each task a rank): a name
    every rank of the step knows without talking to the others, and that a requeued job, whose run
    continues, finds again. None outside such a step (one task: Lightning starts the ranks)."""
    job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    try:
        tasks = int(os.environ.get("SLURM_NTASKS", "1"))
    except ValueError:
        return None
    if not job or not step or tasks < 2 or "SLURM_PROCID" not in os.environ:
        return None
    return run_label([f"slurm-{job}.{step}"])


def multirun_dir(root: str, now: str, mode: RunMode | None) -> str:
    """A multirun's folder (``aiayn-train -m``; ``mode`` is ``hydra.mode``): ``<root>/multirun/<start
    time>``, created here so that no other multirun takes it, as :func:`run_dir` does for a run: one
    started in the same second gets ``<start time>-2``. Resolved once, in the process that launches the
    jobs (Hydra copies the value into each job's config). Outside a multirun it is only a name."""
    folder = Path(root) / "multirun"
    if mode != RunMode.MULTIRUN or process_rank() != 0:
        return str(folder / now)
    return str(reserved_folder(folder, now))


def job_dir(sweep: str, subdir: Any) -> str:
    """A multirun's job folder, ``subdir`` (its number) in the multirun's folder ``sweep``, held
    (:func:`aiayn.files.hold_run_folder`) as Hydra resolves it: in the process that runs the job, and
    before Hydra writes the job's ``.hydra/`` and log there. A job whose folder a living process writes
    (the same multirun started twice, a run continued there by hand) stops here and changes nothing
    in it: :class:`~aiayn.errors.RunFolderBusy`, which Hydra's resolver wraps (aiayn-train reports it in
    one line). The folder is given up when the job ends (:class:`aiayn.cli.train.RunFolderLock`)."""
    subdir = str(subdir)
    if process_rank() == 0:  # the DDP ranks of a SLURM job run the job too: the first one holds it
        hold_run_folder(Path(sweep) / subdir)
    return subdir


def reserved_folder(parent: Path, name: str) -> Path:
    """A new folder ``parent/name`` (or ``name-2``, ``name-3``, ... when that exists), created atomically:
    of two processes choosing one name at once, exactly one gets it."""
    parent.mkdir(parents=True, exist_ok=True)
    attempt = 1
    while True:
        folder = parent / (name if attempt == 1 else f"{name}-{attempt}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            attempt += 1


def latest_run(runs: Path) -> Path | None:
    """The run folder under ``runs`` whose ``checkpoints/last.ckpt`` was written last, or None; a run
    that a living process still writes (:func:`aiayn.files.run_folder_holder`) is not a candidate."""
    found = [
        (last.stat().st_mtime_ns, last.parents[1])
        for last in runs.glob("*/checkpoints/last.ckpt")
        if not any(path.is_symlink() for path in (last, last.parent, last.parents[1]))  # one elsewhere
    ]
    idle = [(written, run) for written, run in found if run_folder_holder(run) is None]
    return max(idle)[1] if idle else None
