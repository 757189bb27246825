"""W&B sweep files run without a W&B server: the trials are proposed by W&B's own sweep engine (the
``sweeps`` package that the W&B server runs: grid, random and bayes behave as there), their commands are
built by the W&B agent's own code from the file's ``command``, and each trial is one process.

A sweep's folder (``outputs/sweeps/<name>`` by default) holds ``sweep.json`` (the sweep file's config and
every trial: parameters, state, exit code, metric), ``logs/<trial>.log`` (each trial's output) and the
trials' run folders, ``<folder>/<their swept overrides>`` (handed to each trial as ``$AIAYN_RUN_DIR``,
which conf/train.yaml's run folder follows; ``$AIAYN_SWEEP_DIR`` groups the W&B runs). Run again, a sweep
skips its finished trials, runs failed and interrupted ones again (they continue from their last
checkpoint) and proposes new ones until it has its count.

Each trial runs in a process group of its own, so that a terminal's Ctrl-C reaches the runner alone: at
SIGINT or SIGTERM the runner sends its trials SIGTERM (they save ``checkpoints/last.ckpt`` and exit),
records them as interrupted and raises :class:`SweepStopped`. A runner killed outright leaves its trials
running; run again, it starts no trial twice: a trial whose run folder a living process still holds
(:func:`aiayn.files.run_folder_holder`) is waited for, and its ``results.json`` taken or the trial continued.

On a machine with GPUs each running trial gets GPUs of its own (:mod:`aiayn.experiments.placement`),
recorded as the trial's ``devices``. ``launcher`` ``slurm`` (or ``submitit-local``) submits each trial as a
job instead (:mod:`aiayn.experiments.launchers`): the runner records its job id and state, a stopping
runner leaves the jobs running, and a runner started again re-attaches to them.

The sweep's metric (``metric.name``) is a key the trials log to their history (``val/bleu``), where W&B's
bayes search and early termination read it; a trial's value is the last one its ``csv/metrics.csv`` holds,
the value W&B's run summary shows: the validation of the checkpoint the run scores.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from aiayn.config.naming import RUN_DIR_ENV, SWEEP_DIR_ENV, run_label
from aiayn.errors import DataError, is_number, show, whole
from aiayn.experiments.launchers import (
    JOB_ID,
    LAUNCHERS,
    LOCAL,
    NO_EXIT_STATUS,
    SLURM,
    STOPPED_STATUSES,
    SUBMITIT_FOLDER,
    SUBMITTED,
    SubmititLauncher,
    TrialHandle,
    TrialJob,
    TrialProcess,
    refresh_slurm_states,
    start_process,
)
from aiayn.experiments.placement import DevicePool, PlacementError, devices_needed, runner_devices
from aiayn.files import atomic_write, run_folder_holder
from aiayn.machine import available_cpus
from aiayn.training.metrics import EVALUATION_METRICS, METRICS_CSV, metric_rows

log = logging.getLogger(__name__)

ARGS_MACRO = "${args_no_hyphens}"  # W&B's macro for the parameters as key=value: Hydra's override syntax
STATE_FILE = "sweep.json"
FINISHED, FAILED, RUNNING, INTERRUPTED = "finished", "failed", "running", "interrupted"
STOP_SECONDS = 60  # stopped trials' time to save last.ckpt, end cleanly and flush W&B before they are killed
POLL_SECONDS = 0.2  # how often the runner looks at its trials and at the run folders it waits for
JOB_POLL_SECONDS = 10.0  # how often it asks SLURM about submitted jobs (sacct is not to be hammered)
FOREIGN_VARIABLES = ("WANDB_RUN_ID", "WANDB_SWEEP_ID", "WANDB_RESUME", "WANDB_RUN_GROUP")  # a surrounding W&B run's
METRICS = tuple(f"{stage}/{name}" for stage in ("val", "test") for name in EVALUATION_METRICS)


class SweepError(ValueError):
    """A sweep file or folder that cannot be run; the message names the file and the fix."""


class SweepStopped(Exception):
    """SIGINT or SIGTERM stopped the runner; its running trials were stopped and recorded as interrupted."""

    def __init__(self, signum: int, stopped: int, state: Path, detached: int = 0) -> None:
        self.signum = signum
        name = signal.Signals(signum).name
        jobs = f"; {detached} submitted job(s) go on, and the runner re-attaches to them" if detached else ""
        super().__init__(
            f"{name} received: {stopped} running trial(s) stopped and recorded as interrupted in {state}{jobs}; "
            "run the same command again to continue the sweep"
        )


def load_sweep(path: Path) -> dict[str, Any]:
    """A W&B sweep file, checked against W&B's own schema and for what a Hydra program needs: the
    parameters passed as overrides through ``${args_no_hyphens}``, and no YAML ``null`` values (W&B
    passes them as the string ``None``; write ``"null"``)."""
    from jsonschema import ValidationError

    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        problem = getattr(error, "problem", None) or str(error)  # YAML: what is wrong, and where
        where = getattr(error, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
        raise SweepError(f"{path}: cannot read the sweep file: {problem}{at}") from None
    if not isinstance(config, dict):
        raise SweepError(f"{path}: a sweep file is a YAML mapping with method, parameters and command")
    engine = _sweeps()
    try:  # run_cap is the server's key (its total of trials), not in the engine's schema
        engine.SweepConfig({key: value for key, value in config.items() if key != "run_cap"})
    except (ValidationError, ValueError) as error:
        message = str(error).splitlines()[0]
        raise SweepError(f"{path}: not a valid W&B sweep: {message}") from None
    command = config.get("command")
    if not isinstance(command, list) or ARGS_MACRO not in command:
        raise SweepError(f"{path}: command must pass the parameters as Hydra overrides: add {ARGS_MACRO} to it")
    if "${program}" in command and not config.get("program"):
        raise SweepError(f"{path}: command uses ${{program}}; set program: aiayn-train (or name the program)")
    script = (
        command.index("${program}") if "${program}" in command else None
    )  # W&B's default: ${interpreter} ${program}
    if script and command[script - 1] == "${interpreter}" and not str(config.get("program")).endswith(".py"):
        raise SweepError(f"{path}: ${{interpreter}} runs Python scripts; drop it for a console script like aiayn-train")
    check_metric(path, config)
    for name, spec in config["parameters"].items():
        check_parameter(path, name, spec)
    try:  # what the engine checks only when it proposes (bayes needs a metric, grid needs discrete values)
        propose(config, [])
    except ValueError as error:
        raise SweepError(f"{path}: {error}") from None
    if "early_terminate" in config:
        log.warning("%s: aiayn-sweep runs every trial to its end; early_terminate applies under wandb agent only", path)
    return config


def parsed_override(text: str) -> Any:
    """``text`` parsed as one Hydra override, as the trial's command line will be; a ``ValueError`` with
    Hydra's reason when it is not one. Both the file's parameter values and the command line's
    overrides are checked with it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        (parsed,) = OverridesParser.create().parse_overrides([text])
    except HydraException as error:
        raise ValueError(str(error).strip().splitlines()[0]) from None
    return parsed


def with_overrides(config: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """The sweep with Hydra ``overrides`` added to the end of every trial's command, where they win over
    the file's own (``hardware=slurm hydra.launcher.partition=gpu`` for a cluster). They become part of
    the sweep's config: a folder holds the trials of one command only."""
    for override in overrides:
        try:
            parsed = parsed_override(override)
        except ValueError as error:
            raise SweepError(f"{override!r} is not a Hydra override ({error})") from None
        if parsed.is_sweep_override():
            raise SweepError(f"{override!r} is a Hydra sweep; a sweep's values belong in its file's parameters")
        if parsed.key_or_group.lstrip("+~") in config["parameters"]:
            raise SweepError(f"{override!r}: {parsed.key_or_group} is one of the sweep's parameters; edit its values")
    return {**config, "command": [*config["command"], *overrides]} if overrides else config


def check_metric(path: Path, config: dict[str, Any]) -> None:
    """``metric.name`` must be a key the trials log to their history: W&B's bayes search and
    hyperband read it there (a key only the run summary holds, like results.json's ``val_bleu``, leaves
    them searching blind)."""
    name = config.get("metric", {}).get("name")
    if name is not None and name not in METRICS:
        hint = f"; did you mean {name.replace('_', '/', 1)}?" if name.replace("_", "/", 1) in METRICS else ""
        raise SweepError(
            f"{path}: metric.name {name!r} is not a key the trials log to their history, where W&B's search "
            f"reads it{hint} (one of {', '.join(METRICS)})"
        )


def check_parameter(path: Path, name: str, spec: dict[str, Any]) -> None:
    """A parameter must reach Hydra as one plain override: no nested parameters (they arrive as a dict),
    no YAML null (W&B passes it as "None"), and values Hydra reads as one value (``a,b`` is a sweep)."""
    if "parameters" in spec:
        raise SweepError(f'{path}: parameters.{name} is nested; Hydra takes no dict: use dotted keys ("{name}.x:")')
    for value in spec.get("values", [spec["value"]] if "value" in spec else []):
        if value is None:
            raise SweepError(f'{path}: parameters.{name} has a YAML null; W&B passes it as "None": write "null"')
        try:
            override = parsed_override(f"{name}={value}")
        except ValueError as error:
            raise SweepError(f"{path}: parameters.{name}: {value!r} is not a Hydra override value ({error})") from None
        if override.is_sweep_override():
            raise SweepError(f"{path}: parameters.{name}: {value!r} reads as a Hydra sweep; quote it: \"'{value}'\"")


def _sweeps() -> Any:
    """W&B's sweep engine (its pydantic models still use v1 option names: a warning, not a problem)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Valid config keys have changed in V2", category=UserWarning)
        import sweeps

    return sweeps


def _plain(value: Any) -> Any:
    """numpy scalars (random and bayes draw them) as the Python values JSON and the command expect."""
    return value.item() if hasattr(value, "item") else value


def propose(config: dict[str, Any], trials: Sequence[Trial], n: int = 1) -> list[dict[str, Any]]:
    """Up to ``n`` new parameter sets, as a W&B server would propose them given ``trials``: grid goes
    through every combination once, random draws, bayes fits the metric of the finished trials."""
    engine = _sweeps()
    runs = [trial.as_sweep_run(engine, config) for trial in trials]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        proposals = engine.next_runs(config, runs, validate=False, n=n)
    return [{key: _plain(spec["value"]) for key, spec in run.config.items()} for run in proposals if run is not None]


def trial_command(config: dict[str, Any], params: dict[str, Any]) -> list[str]:
    """The command ``wandb agent`` would run for ``params``, built by the agent's own functions:
    ``${env}``, ``${interpreter}`` (this Python), ``${program}``, the argument macros, and
    ``${envvar:NAME}``."""
    from wandb.sdk.launch.sweeps import utils

    macros = utils.create_sweep_command_args({"args": {key: {"value": value} for key, value in params.items()}})
    macros |= {"env": ["/usr/bin/env"], "interpreter": [sys.executable], "program": [str(config.get("program", ""))]}
    command = []
    for chunk in utils.create_sweep_command(list(config["command"])):
        chunk = str(chunk)
        if chunk.startswith("${") and chunk.endswith("}"):
            command += macros.get(chunk[2:-1]) or []
        else:
            command.append(chunk)
    return command


def command_overrides(command: Sequence[str]) -> list[str]:
    """The Hydra overrides of a trial's command: its ``key=value`` arguments."""
    return [arg for arg in command if "=" in arg and not arg.startswith("-")]


def expand(config: dict[str, Any], limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` trials the sweep would run (all of a grid when it has fewer), each proposal
    counted as finished (random and bayes then draw the next; bayes sees a metric of 0)."""
    trials: list[Trial] = []
    while len(trials) < limit:
        proposals = propose(config, trials)
        if not proposals:
            break
        trials.append(Trial(number=len(trials) + 1, params=proposals[0], state=FINISHED, metric=0.0))
    return [trial.params for trial in trials]


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

    def as_sweep_run(self, engine: Any, config: dict[str, Any]) -> Any:
        # an interrupted trial runs again: to bayes it is under way ("preempted"), not a failure to avoid
        state = {FINISHED: "finished", FAILED: "failed", INTERRUPTED: "preempted"}.get(self.state, "running")
        metric = config.get("metric", {}).get("name")
        summary = {metric: self.metric} if metric and self.metric is not None else {}
        return engine.SweepRun(
            name=self.name,
            state=state,
            config={key: {"value": value} for key, value in self.params.items()},
            summary_metrics=summary,
        )


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
        if not path.exists():
            return cls(folder, config, [])
        try:
            saved = json.loads(path.read_text())
            trials = [Trial(**trial) for trial in saved["trials"]]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise SweepError(f"{path}: unreadable sweep state ({error}); move it away to start afresh") from None
        if trials and saved.get("config") != json.loads(json.dumps(config)):
            raise SweepError(
                f"{folder} holds a sweep of another config than {source}; pass --dir <another folder> "
                "or move the old one away"
            )
        for trial in trials:
            check_trial_record(path, trial)
            check_trial_params(path, trial, config)
        for trial in trials:  # a runner that was killed left them running (they may still be)
            if trial.state == RUNNING and not trial.submitted:  # submitted jobs are re-attached to
                trial.state, trial.error = INTERRUPTED, "its runner ended while it ran"
        return cls(folder, config, trials)

    def results(self, trial: Trial) -> Path:
        """The ``results.json`` of ``trial``'s run, once it has finished."""
        return self.folder / (trial.run_dir or "") / "results.json"

    def save(self) -> None:
        state = {"config": self.config, "trials": [asdict(t) for t in self.trials]}
        atomic_write(self.folder / STATE_FILE, json.dumps(state, indent=2))  # a killed runner leaves it whole


def check_trial_record(path: Path, trial: Trial) -> None:
    """A trial as ``sweep.json`` records it is untrusted: its run folder must lie inside the sweep's folder
    (a runner would write there and hand it to the trial), its job id be a job id, its devices names."""
    run_dir = trial.run_dir
    if run_dir is not None and (
        not isinstance(run_dir, str)
        or Path(run_dir).is_absolute()
        or ".." in Path(run_dir).parts
        or not run_dir
        or len(Path(run_dir).parts) != 1  # one folder of the sweep's own: not ".", not nested
        or run_dir in (STATE_FILE, "logs", SUBMITIT_FOLDER)  # nor one of the runner's
        or not (path.parent / run_dir).resolve().is_relative_to(path.parent.resolve())  # a link on the way
    ):
        raise SweepError(f"{path}: trial {trial.number}'s run_dir {run_dir!r} is not a folder inside the sweep's")
    if trial.job_id is not None and not (isinstance(trial.job_id, str) and JOB_ID.fullmatch(trial.job_id)):
        raise SweepError(f"{path}: trial {trial.number}'s job_id {trial.job_id!r} is not a job id")
    if trial.devices is not None and not (
        isinstance(trial.devices, list) and all(isinstance(d, str) for d in trial.devices)
    ):
        raise SweepError(f"{path}: trial {trial.number}'s devices {trial.devices!r} are not device names")
    if not whole(trial.number, 0):
        raise SweepError(f"{path}: a trial's number {show(trial.number):.40} is not a whole number")
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
        odd = sorted(set(trial.params) ^ set(specs))[0]
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


def _same_value(a: Any, b: Any) -> bool:
    """Equal as JSON keeps them (numpy scalars and ints become plain numbers, tuples lists)."""
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _scalar(value: Any) -> bool:
    """A swept value as W&B sweep files give them: a number, a string, a flag, null, or a list of them."""
    if isinstance(value, list):
        return all(_scalar(item) and not isinstance(item, list) for item in value)
    return value is None or isinstance(value, str | bool) or is_number(value)


def default_folder(config: dict[str, Any], source: Path) -> Path:
    """``outputs/sweeps/<the file's name: key, else its file name>``; a name that is not one plain folder name
    (``../x``, ``/x``, ``a/b``, ``.``, empty) would put the sweep and its trials somewhere else."""
    name = str(Path(source).stem if config.get("name") is None else config["name"])
    if name in ("", "..") or Path(name).name != name:
        raise SweepError(
            f"{source}: name: {name!r} is not a folder name (the sweep's folder is outputs/sweeps/<name>); "
            "use a plain name, without / or .., or pass --dir <folder>"
        )
    return Path("outputs") / "sweeps" / name


def trial_count(config: dict[str, Any], count: int | None, source: Path) -> int | None:
    """How many trials the sweep holds in all: ``count``, else the file's ``run_cap``, else (grid) every
    combination; random and bayes never end by themselves."""
    count = count or config.get("run_cap")
    if count is None and config["method"] != "grid":
        raise SweepError(f"{source}: a {config['method']} sweep never ends; pass --count N or set run_cap: N")
    return count


def run_sweep(
    source: Path,
    folder: Path | None = None,
    count: int | None = None,
    parallel: int = 1,
    report: Callable[[Trial], None] = lambda trial: None,
    launcher: str = LOCAL,
    overrides: Sequence[str] = (),
) -> SweepState:
    """Run the sweep file ``source`` until it has ``count`` trials (see :func:`trial_count`), ``parallel``
    at a time, where ``launcher`` says (:mod:`aiayn.experiments.launchers`), each trial's command ending
    with ``overrides`` (:func:`with_overrides`); returns the sweep's state (its folder, every trial). A
    trial that fails is recorded and the others go on."""
    if parallel < 1:
        raise SweepError(f"--parallel {parallel}: run at least one trial at a time")
    if launcher not in LAUNCHERS:
        raise SweepError(f"--launcher {launcher}: use one of {', '.join(LAUNCHERS)}")
    config = with_overrides(load_sweep(source), overrides)
    folder = Path(folder or default_folder(config, source)).resolve()
    total = trial_count(config, count, source)
    folder.mkdir(parents=True, exist_ok=True)
    with exclusive(folder):
        state = SweepState.open(folder, config, source)
        state.save()
        run_trials(state, total, parallel, report, launcher)
    return state


@contextmanager
def exclusive(folder: Path) -> Iterator[None]:
    """One runner per sweep folder: a second would start the same trials in the same run folders."""
    with open(folder / ".lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SweepError(f"another aiayn-sweep is running in {folder}; wait for it or stop it") from None
        yield


def run_trials(
    state: SweepState, total: int | None, parallel: int, report: Callable[[Trial], None], launcher: str = LOCAL
) -> None:
    """Run the sweep's unfinished trials, then new ones, until it has ``total``; SIGINT or SIGTERM stops
    the running processes (submitted jobs go on) and raises :class:`SweepStopped`."""
    runner = TrialRunner(state, total, parallel, report, launcher)
    with stop_requests() as stop:
        try:
            runner.run(stop)
        finally:  # stopped, or an error of the runner's own: no trial is left running unwatched
            stopped, detached = runner.stop_all(stop)
    if stop.signum is not None:
        raise SweepStopped(stop.signum, stopped, state.folder / STATE_FILE, detached)


@dataclass
class Launched:
    """A running trial: a process this runner started, or a submitted job it watches."""

    trial: Trial
    handle: TrialHandle
    started: float
    next_poll: float = 0.0  # when to ask about a submitted job next


class StopRequest:
    """What the runner's SIGINT and SIGTERM handlers record, for the runner to act on between two of its
    steps (never between a trial's start and its record): the first signal asks it to stop its trials
    gently; a second Ctrl-C kills them at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.hurry = False
        self.processes: list[TrialProcess] = []  # the trials being stopped

    def __call__(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        elif signum == signal.SIGINT:
            self.hurry = True
            for process in self.processes:
                process.signal(signal.SIGKILL)


@contextmanager
def stop_requests() -> Iterator[StopRequest]:
    """SIGINT and SIGTERM recorded in a :class:`StopRequest` for the duration of the block."""
    stop = StopRequest()
    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class TrialRunner:
    """The trials of one runner, ``parallel`` at a time, none started in a run folder that another process
    holds: a trial that outlived a killed runner is waited for (it takes a place), not started twice. On a
    machine with GPUs a trial starts once the devices it needs are free."""

    def __init__(
        self, state: SweepState, total: int | None, parallel: int, report: Callable[[Trial], None], launcher: str
    ) -> None:
        self.state, self.total, self.parallel, self.report = state, total, parallel, report
        self.launcher = launcher
        self.running: dict[int, Launched] = {}
        self.waiting: dict[int, Trial] = {}  # their run folders are held by processes this runner did not start
        self.configs: dict[int, Any] = {}  # composed trial configs, by trial number
        # The scheduler places submitted jobs; here, the runner places its own processes.
        self.pool = DevicePool(runner_devices() if launcher == LOCAL else [])
        if self.pool.devices:
            log.info("placing trials on %d device(s): %s", len(self.pool.devices), ",".join(self.pool.devices))
        self.env = trial_environment(state.folder, parallel)
        for trial in state.trials:
            if trial.state == RUNNING and trial.submitted:
                self.reattach(trial)
        self.queue = [trial for trial in state.trials if trial.state not in (FINISHED, RUNNING)]

    def run(self, stop: StopRequest) -> None:
        """Until every trial has ended, or ``stop`` holds a signal."""
        while stop.signum is None:
            while len(self.running) + len(self.waiting) < self.parallel and stop.signum is None:
                trial = self.queue.pop(0) if self.queue else new_trial(self.state, self.total)
                if trial is None:
                    break
                if not self.launch(trial):  # its devices are not free yet: it starts first once they are
                    self.queue.insert(0, trial)
                    break
            if not self.running and not self.waiting:
                return
            self.poll()
            time.sleep(POLL_SECONDS)

    def launch(self, trial: Trial) -> bool:
        """Start ``trial``; or, when a living process holds its run folder, wait for that process; or, when
        such a process has ended and left ``results.json``, take its results. False when the devices it
        needs are not free (nothing was done)."""
        trial.run_dir = trial_folder(trial, self.state)
        folder = self.state.folder / trial.run_dir
        holder = run_folder_holder(folder)
        if holder:
            trial.state, trial.error = INTERRUPTED, f"waiting for {holder}, which holds its run folder"
            log.warning("%s: not started: its run folder %s is in use by %s; waiting", trial.name, folder, holder)
            self.waiting[trial.number] = trial
            # The process its runner started still runs on the devices it was given: none is given twice.
            trial.devices = self.pool.hold(trial.devices or []) if self.pool.devices else trial.devices
            self.state.save()
            return True
        if trial.state == INTERRUPTED and self.state.results(trial).is_file():  # it ended while no runner watched
            log.info("%s: taking results.json of the run that ended in %s", trial.name, folder)
            trial.returncode, trial.seconds = None, None
            take_results(trial, self.state)
            self.record(trial)
            return True
        trial.command = trial_command(self.state.config, trial.params)
        try:
            config = self.trial_config(trial)
            devices = self.place(trial, config)
        except (PlacementError, ValueError) as error:  # never placeable, or no config: recorded as failed
            trial.state, trial.error = FAILED, f"not started: {str(error).splitlines()[0]}"
            self.record(trial)
            return True
        if devices is None:
            return False
        trial.devices = devices if self.pool.devices else None
        handle, started = start_trial(trial, self.state, self.env, self.launcher, config, devices)
        if handle is None:
            self.pool.give_back(devices)
            self.record(trial)
        else:
            self.running[trial.number] = Launched(trial, handle, started)
            self.state.save()
        return True

    def trial_config(self, trial: Trial) -> Any:
        """The trial's composed config, where the runner needs it (to place it on GPUs, or for its job's
        settings); composed once per trial, not at every look at whether its devices are free."""
        if not self.pool.devices and self.launcher == LOCAL:
            return None
        if trial.number not in self.configs:
            self.configs[trial.number] = compose_trial(trial.command)
        return self.configs[trial.number]

    def place(self, trial: Trial, config: Any) -> list[str] | None:
        """The devices ``trial`` runs on ([] for none), now taken; None while they are not free."""
        if config is None or not self.pool.devices:
            return []
        needed = devices_needed(config.trainer, len(self.pool.devices))
        devices = self.pool.take(needed)
        if devices is not None:
            free = len(self.pool.free)
            log.info("%s: on device(s) %s (%d of %d free now)", trial.name, ",".join(devices) or "none",
                     free, len(self.pool.devices))  # fmt: skip
        return devices

    def reattach(self, trial: Trial) -> None:
        """Watch the job a runner before this one submitted for ``trial``."""
        assert trial.launcher is not None and trial.job_id is not None
        handle = SubmititLauncher(trial.launcher, self.state.folder).attach(trial.job_id, exit_file(self.state, trial))
        log.info("%s: re-attached to %s job %s", trial.name, trial.launcher, trial.job_id)
        self.running[trial.number] = Launched(trial, handle, time.monotonic())

    def poll(self) -> None:
        """Record the trials that ended; launch those whose run folders were released."""
        now = time.monotonic()
        due = [each for each in self.running.values() if each.handle.detaches and now >= each.next_poll]
        if any(each.trial.launcher == SLURM for each in due):
            refresh_slurm_states()
        for launched in list(self.running.values()):
            if launched.handle.detaches:
                if launched not in due:
                    continue
                launched.next_poll = now + (JOB_POLL_SECONDS if launched.trial.launcher == SLURM else 0)
                self.job_state(launched)
            returncode = launched.handle.poll()
            if returncode is not None:
                del self.running[launched.trial.number]
                self.pool.give_back(launched.trial.devices or [])
                seconds = time.monotonic() - launched.started
                if launched.handle.detaches and returncode in (NO_EXIT_STATUS, *STOPPED_STATUSES):
                    self.job_stopped(launched.trial, returncode)
                else:
                    finish_trial(launched.trial, returncode, seconds, self.state)
                self.record(launched.trial)
        for trial in list(self.waiting.values()):
            if run_folder_holder(self.state.folder / (trial.run_dir or "")) is None:
                del self.waiting[trial.number]
                self.pool.give_back(trial.devices or [])
                if not self.launch(trial):  # its devices are not free now: it starts first once they are
                    self.queue.insert(0, trial)

    def job_stopped(self, trial: Trial, returncode: int) -> None:
        """A submitted trial whose job ended before the trial did. Stopped at a signal after saving its
        last checkpoint (a preemption that submitit did not requeue), it is submitted again and continues
        in its folder; a job that left no exit status (cancelled, killed) runs again when the sweep does."""
        trial.state, trial.returncode = INTERRUPTED, returncode
        if str(trial.job_state).startswith("CANCELLED"):  # by someone: not undone here
            trial.error = (
                f"job {trial.job_id} was cancelled (exit code {returncode}); it runs again when the sweep does"
            )
            log.warning("%s: %s", trial.name, trial.error)
        elif returncode == NO_EXIT_STATUS:
            trial.error = (
                f"job {trial.job_id} ended ({trial.job_state}) without an exit status; see logs/{trial.name}.log "
                f"and {SUBMITIT_FOLDER}/{trial.job_id}/"
            )
            log.warning("%s: %s; it runs again when the sweep does", trial.name, trial.error)
        else:
            trial.error = f"stopped at a signal (exit code {returncode}) after saving its checkpoint; submitted again"
            log.warning("%s: %s", trial.name, trial.error)
            self.queue.append(trial)

    def job_state(self, launched: Launched) -> None:
        """Record what the scheduler says of a submitted trial's job, when it changed."""
        state = launched.handle.state()
        if state != launched.trial.job_state:
            log.info("%s: job %s %s", launched.trial.name, launched.handle.job_id, state)
            launched.trial.job_state = state
            self.state.save()

    def stop_all(self, stop: StopRequest) -> tuple[int, int]:
        """Stop the trials running as this runner's processes: SIGTERM to each one's process group (the
        trial saves ``checkpoints/last.ckpt`` and exits, its workers with it), SIGKILL to the groups still
        there after :data:`STOP_SECONDS` or at a second Ctrl-C. Each is recorded as interrupted (or as it
        ended, when it ended by itself first). Submitted jobs go on (recorded as running, with their ids).
        Returns how many were stopped and how many jobs go on."""
        launched = [each for each in self.running.values() if not each.handle.detaches]
        processes = [each.handle for each in launched if isinstance(each.handle, TrialProcess)]
        stop.processes = processes
        for process in processes:
            process.signal(signal.SIGKILL if stop.hurry else signal.SIGTERM)
        deadline = time.monotonic() + STOP_SECONDS
        for each, process in zip(launched, processes, strict=True):
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.signal(signal.SIGKILL)
                process.wait(timeout=None)
            del self.running[each.trial.number]
            self.pool.give_back(each.trial.devices or [])
            returncode, seconds = process.process.returncode, time.monotonic() - each.started
            if returncode < 0 or returncode == 128 + signal.SIGTERM:  # stopped, or killed, by the runner
                trial = each.trial
                trial.state, trial.returncode, trial.seconds = INTERRUPTED, returncode, seconds
                trial.error = f"stopped (exit code {returncode}); it continues when the sweep runs again"
            else:
                finish_trial(each.trial, returncode, seconds, self.state)
            self.record(each.trial)
        detached = len(self.running)
        self.running.clear()
        return len(launched), detached

    def record(self, trial: Trial) -> None:
        self.state.save()
        self.report(trial)


def new_trial(state: SweepState, total: int | None) -> Trial | None:
    if total is not None and len(state.trials) >= total:
        return None
    proposals = propose(state.config, state.trials)
    if not proposals:
        return None
    trial = Trial(number=len(state.trials) + 1, params=proposals[0])
    state.trials.append(trial)
    return trial


def trial_environment(folder: Path, parallel: int) -> dict[str, str]:
    """Trials write into the sweep's folder and log to W&B offline unless ``WANDB_MODE`` says otherwise;
    trials that share the CPUs share their threads."""
    env = dict(os.environ)
    for name in FOREIGN_VARIABLES:
        env.pop(name, None)
    env[SWEEP_DIR_ENV] = str(folder)
    env.setdefault("WANDB_MODE", "offline")
    if parallel > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, available_cpus() // parallel)))
    return env


def trial_folder(trial: Trial, state: SweepState) -> str:
    """The trial's run folder, named after its parameters; a second trial of the same parameters (random
    and bayes may propose them again) gets its own, suffixed with its trial number."""
    if trial.run_dir:  # run again: continue in its own folder
        return trial.run_dir
    folder = run_label([f"{key}={value}" for key, value in trial.params.items()])
    if any(other.run_dir == folder for other in state.trials if other is not trial):
        folder += f"-{trial.name}"
    return folder


def compose_trial(command: Sequence[str]) -> Any:
    """The trial's training config with Hydra's node (its launcher settings), composed from the command's
    overrides as ``aiayn-train`` composes it; a ValueError with Hydra's reason when it does not compose."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from aiayn.config.compose import compose_config

    try:
        return compose_config("train", command_overrides(command))
    except (HydraException, OmegaConfBaseException) as error:
        raise ValueError(f"its overrides do not compose: {error}") from None


def exit_file(state: SweepState, trial: Trial) -> Path:
    """Where a submitted trial's job writes its exit status."""
    return state.folder / "logs" / f"{trial.name}.exit.json"


def start_trial(
    trial: Trial, state: SweepState, env: dict[str, str], launcher: str, config: Any, devices: list[str]
) -> tuple[TrialHandle | None, float]:
    """Start the trial's process, or submit its job (None when it cannot start: the trial is recorded as
    failed)."""
    trial.run_dir = trial_folder(trial, state)
    trial.state, trial.returncode, trial.metric, trial.error = RUNNING, None, None, None
    trial.launcher, trial.job_id, trial.job_state = launcher, None, None
    logs = state.folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # As `wandb agent` does: the trial's parameters in W&B's format, named by $WANDB_SWEEP_PARAM_PATH
    # (W&B records them in the run's config).
    params = logs / f"{trial.name}.params.yaml"
    params.write_text(yaml.safe_dump({key: {"value": value} for key, value in trial.params.items()}))
    log.info("%s: %s", trial.name, " ".join(trial.command))
    own = {"WANDB_SWEEP_PARAM_PATH": str(params), RUN_DIR_ENV: str(state.folder / trial.run_dir)}
    if trial.devices is not None:  # placed by the runner: these GPUs (none for a CPU trial)
        own["CUDA_VISIBLE_DEVICES"] = ",".join(trial.devices)
    log_file = logs / f"{trial.name}.log"
    handle: TrialHandle
    if launcher == LOCAL:
        try:
            handle = start_process(trial.command, {**env, **own}, log_file)
        except OSError as error:
            trial.state, trial.error = FAILED, f"cannot start {trial.command[0]}: {error.strerror or error}"
            return None, time.monotonic()
    else:
        variables = {key: value for key, value in trial_variables(env).items() if key != "OMP_NUM_THREADS"}
        variables |= own  # a job's node has its own CPUs (cpus_per_task): not the runner's share
        job = TrialJob(trial.command, variables, list(FOREIGN_VARIABLES), str(log_file), str(exit_file(state, trial)))
        try:
            handle = SubmititLauncher(launcher, state.folder).submit(f"{state.folder.name}-{trial.name}", job,
                                                                     config.hydra.launcher)  # fmt: skip
        except (OSError, RuntimeError, NameError, AssertionError, ValueError) as error:
            # sbatch refusing a partition, no SLURM here, a setting submitit does not know: every trial
            # of the sweep would meet it, so the sweep stops (this trial recorded as failed).
            reason = " ".join(str(error).split())[:400] or type(error).__name__
            trial.state, trial.error = FAILED, f"not submitted: {reason}"
            state.save()
            raise SweepError(
                f"{trial.name} could not be submitted to {launcher}: {reason}; fix the job's settings "
                "(hydra.launcher.*) and run the sweep again"
            ) from None
    trial.job_id = handle.job_id
    log.info("%s: %s %s", trial.name, "job" if handle.detaches else "process", trial.job_id)
    return handle, time.monotonic()


def trial_variables(env: dict[str, str]) -> dict[str, str]:
    """What a trial's environment sets beyond the runner's own: a submitted job's node brings its own
    environment (SLURM's, the node's CUDA and paths), to which these are added."""
    return {key: value for key, value in env.items() if os.environ.get(key) != value}


def finish_trial(trial: Trial, returncode: int, seconds: float, state: SweepState) -> None:
    """Record how a trial ended: finished with its metric (from the run's ``results.json``) or failed."""
    trial.returncode, trial.seconds = returncode, seconds
    results = state.results(trial)
    if returncode != 0:
        trial.state, trial.error = FAILED, f"exit code {returncode}; see logs/{trial.name}.log"
        return
    if not results.is_file():
        trial.state, trial.error = FAILED, f"no {results} after a clean exit; see logs/{trial.name}.log"
        return
    take_results(trial, state)


def take_results(trial: Trial, state: SweepState) -> None:
    """Record ``trial`` as finished, with its metric: the last value of ``metric.name`` in its run's
    ``csv/metrics.csv`` (the history W&B's search reads; its last value is the run summary's)."""
    trial.state, trial.error = FINISHED, None
    metric = state.config.get("metric", {}).get("name")
    if metric:
        history = state.folder / (trial.run_dir or "") / METRICS_CSV
        trial.metric = last_logged(history, metric)
        if trial.metric is None:  # bayes would search blind: say so
            trial.error = f"{history} holds no value of metric.name {metric!r}"
            log.warning("%s: %s", trial.name, trial.error)


def last_logged(history: Path, key: str) -> float | None:
    """The last finite number ``key`` has in the metrics CSV ``history`` (None: no such file, column or
    value). The file is the trial's, read as untrusted: damaged rows are left out (:func:`metric_rows`),
    a file that is no metrics CSV counts as none."""
    try:
        values = [row.get(key) for row in metric_rows(history)]
    except (OSError, DataError):
        return None
    for value in reversed(values):
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            return number
    return None
