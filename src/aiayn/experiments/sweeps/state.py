"""A sweep's record, ``sweep.json``, and the trials it holds: the bottom of the sweeps package and the one
owner of the file's format (every trial's fields, their types and their checks) and of a trial's name
(``trial-0001``). The runner writes the file through :class:`SweepState`; ``aiayn-report`` reads a copied
sweep's trials through :func:`read_trials`.

A sweep's folder holds ``sweep.json``, ``logs/`` (each trial's output, parameters and, for a submitted
trial, exit status), ``.submitit/`` (submitit's job files) and the trials' run folders.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aiayn.errors import DataError, first_line, is_number, nesting, show, whole
from aiayn.experiments.results import RESULTS_FILE
from aiayn.files import atomic_write, read_plain_file

STATE_FILE = "sweep.json"
FINISHED, FAILED, RUNNING, INTERRUPTED = "finished", "failed", "running", "interrupted"
# Where a trial was started (:mod:`aiayn.experiments.sweeps.launchers`): a process here, or a job of its own.
LOCAL, SLURM, SUBMITIT_LOCAL = "local", "slurm", "submitit-local"
LAUNCHERS = (LOCAL, SLURM, SUBMITIT_LOCAL)
SUBMITTED = (SLURM, SUBMITIT_LOCAL)
SUBMITIT_FOLDER = ".submitit"  # in the sweep's folder: submitit's job files, one folder per job id
JOB_ID = re.compile(r"\d+(_\d+)?")  # a SLURM job id (array jobs: <id>_<index>), or a local controller's pid
STATE_BYTES = 64 << 20  # sweep.json grows with its trials: a few kilobytes each
# The deepest a sweep file's config nests (nested parameters take a few levels); sweep.json holds it one
# level down (aiayn.errors.nesting).
DEEPEST = 32


class SweepError(ValueError):
    """A sweep file or folder that cannot be run; the message names the file and the fix."""


@dataclass
class Trial:
    """One trial of a sweep, as ``sweep.json`` records it."""

    number: int
    params: dict[str, Any]
    state: str = RUNNING
    command: list[str] = field(default_factory=list)
    run_dir: str | None = None  # relative to the sweep's folder (which may move)
    returncode: int | None = None
    metric: float | None = None
    error: str | None = None
    seconds: float | None = None
    devices: list[str] | None = None  # the GPUs it was given (CUDA_VISIBLE_DEVICES), when the runner placed it
    launcher: str | None = None  # where it was last started: local, slurm, submitit-local
    job_id: str | None = None  # its process or scheduler job
    job_state: str | None = None  # what the scheduler last said of its job

    @property
    def submitted(self) -> bool:
        """A job of a scheduler: it outlives the runner, which re-attaches to it by its id."""
        return self.launcher in SUBMITTED and self.job_id is not None

    @property
    def name(self) -> str:
        return f"trial-{self.number:04d}"


class SweepState:
    """``sweep.json`` of a sweep's folder: the sweep's config and its trials, rewritten atomically after
    every change so that an interrupted runner loses nothing."""

    def __init__(self, folder: Path, config: dict[str, Any], trials: list[Trial]) -> None:
        self.folder = folder
        self.config = config
        self.trials = trials

    @classmethod
    def open(cls, folder: Path, config: dict[str, Any], source: Path) -> SweepState:
        path = folder / STATE_FILE
        try:
            saved = json.loads(read_plain_file(path, STATE_BYTES).decode("utf-8"))
        except FileNotFoundError:
            return cls(folder, config, [])
        except DataError as error:  # not a plain file, or larger than a sweep's record
            raise SweepError(f"{error}; move it away to start afresh") from None
        except (OSError, ValueError, RecursionError) as error:  # not UTF-8, not JSON, nested too deeply to parse
            raise SweepError(
                f"{path}: unreadable sweep state ({first_line(error)}); move it away to start afresh"
            ) from None
        trials = read_trials(saved, path)
        if trials and saved.get("config") != json.loads(json.dumps(config)):
            raise SweepError(
                f"{folder} holds a sweep of another config than {source}; pass --dir <another folder> "
                "or move the old one away"
            )
        for trial in trials:
            check_trial_params(path, trial, config)
        for trial in trials:  # a runner that was killed left them running (they may still be)
            if trial.state == RUNNING and not trial.submitted:  # submitted jobs are re-attached to
                trial.state, trial.error = INTERRUPTED, "its runner ended while it ran"
        return cls(folder, config, trials)

    def results(self, trial: Trial) -> Path:
        """The ``results.json`` of ``trial``'s run, once it has finished."""
        return self.folder / (trial.run_dir or "") / RESULTS_FILE

    def save(self) -> None:
        state = {"config": self.config, "trials": [asdict(t) for t in self.trials]}
        atomic_write(self.folder / STATE_FILE, json.dumps(state, indent=2))  # a killed runner leaves it whole


def read_trials(saved: Any, path: Path) -> list[Trial]:
    """The trials of ``saved``, the parsed content of the ``sweep.json`` at ``path``, each record checked
    (:func:`check_trial_record`): :class:`SweepError` in one line naming the file and the field when one
    is not as aiayn-sweep writes it."""
    if nesting(saved) > DEEPEST + 1:
        raise SweepError(f"{path}: nested deeper than {DEEPEST + 1} levels; it is not as aiayn-sweep writes it")
    try:
        trials = [Trial(**trial) for trial in saved["trials"]]
    except (KeyError, TypeError) as error:
        raise SweepError(f"{path}: unreadable sweep state ({error!s:.200}); move it away to start afresh") from None
    for trial in trials:
        check_trial_record(path, trial)
    return trials


def check_trial_record(path: Path, trial: Trial) -> None:
    """A trial as ``sweep.json`` records it is untrusted: its run folder must lie inside the sweep's folder
    (a runner would write there and hand it to the trial), its job id be a job id, its devices names."""
    if not whole(trial.number, 0):  # first: the messages below name the trial by it
        raise SweepError(f"{path}: a trial's number {show(trial.number):.40} is not a whole number")
    run_dir = trial.run_dir
    if run_dir is not None and (
        not isinstance(run_dir, str)
        or Path(run_dir).is_absolute()
        or ".." in Path(run_dir).parts
        or not run_dir
        or "\x00" in run_dir  # no path holds one
        or len(Path(run_dir).parts) != 1  # one folder of the sweep's own: not ".", not nested
        or run_dir in (STATE_FILE, "logs", SUBMITIT_FOLDER)  # nor one of the runner's
        or not _inside(path.parent, run_dir)  # a link on the way
    ):
        raise SweepError(f"{path}: trial {trial.number}'s run_dir {run_dir!r:.60} is not a folder inside the sweep's")
    if trial.job_id is not None and not (isinstance(trial.job_id, str) and JOB_ID.fullmatch(trial.job_id)):
        raise SweepError(f"{path}: trial {trial.number}'s job_id {trial.job_id!r:.60} is not a job id")
    if trial.devices is not None and not (
        isinstance(trial.devices, list) and all(isinstance(d, str) for d in trial.devices)
    ):
        raise SweepError(f"{path}: trial {trial.number}'s devices {trial.devices!r:.60} are not device names")
    # Every other field is read back (printed, compared, passed to the sweep engine): the types aiayn writes.
    kinds: dict[str, Callable[[Any], bool]] = {
        "params": lambda v: isinstance(v, dict) and all(isinstance(k, str) and _scalar(x) for k, x in v.items()),
        "state": lambda v: v in (FINISHED, FAILED, RUNNING, INTERRUPTED),
        "command": lambda v: isinstance(v, list) and all(isinstance(part, str) for part in v),
        "returncode": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
        "metric": lambda v: v is None or is_number(v),
        "seconds": lambda v: v is None or (is_number(v) and v >= 0),
        "error": lambda v: v is None or isinstance(v, str),
        "launcher": lambda v: v is None or v in LAUNCHERS,
        "job_state": lambda v: v is None or isinstance(v, str),
    }
    for name, fits in kinds.items():
        if not fits(getattr(trial, name)):
            raise SweepError(
                f"{path}: trial {trial.number}'s {name}={show(getattr(trial, name)):.60} is not what aiayn-sweep "
                "writes there; move the file away to start the sweep afresh"
            )


def check_trial_params(path: Path, trial: Trial, config: dict[str, Any]) -> None:
    """A recorded trial's parameters are the sweep file's: its names, each value one the file allows
    (one of its ``values``, its ``value``, a number for a distribution). They become the overrides of the
    trial's command when it runs again, and an override can name any setting (a ``_target_`` to build)."""
    specs = config.get("parameters") if isinstance(config.get("parameters"), dict) else {}
    if set(trial.params) != set(specs):
        odd = sorted(set(trial.params) ^ set(specs), key=str)[0]  # a sweep file's YAML may have number keys
        raise SweepError(
            f"{path}: trial {trial.number}'s params name {odd!r:.60}, not the sweep file's parameters; "
            "move the file away to start the sweep afresh"
        )
    for name, value in trial.params.items():
        spec = specs[name] if isinstance(specs[name], dict) else {}
        if "values" in spec:
            allowed = isinstance(spec["values"], list) and any(_same_value(value, v) for v in spec["values"])
        elif "value" in spec:
            allowed = _same_value(value, spec["value"])
        else:
            allowed = is_number(value)
        if not allowed:
            raise SweepError(
                f"{path}: trial {trial.number}'s params.{name}={show(value):.60} is not a value the sweep file gives "
                "it; move the file away to start the sweep afresh"
            )


def _inside(folder: Path, name: str) -> bool:
    """``folder / name`` lies in ``folder`` once links are followed; a loop of links does not."""
    try:
        return (folder / name).resolve().is_relative_to(folder.resolve())
    except (OSError, RuntimeError):  # RuntimeError: the loop, as Path.resolve reports it
        return False


def _same_value(a: Any, b: Any) -> bool:
    """Equal as JSON keeps them (numpy scalars and ints become plain numbers, tuples lists)."""
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _scalar(value: Any) -> bool:
    """A swept value as W&B sweep files give them: a number, a string, a flag, null, or a list of them."""
    if isinstance(value, list):
        return all(_scalar(item) and not isinstance(item, list) for item in value)
    return value is None or isinstance(value, str | bool) or is_number(value)
