"""A W&B sweep file as ``wandb sweep`` reads it: loaded and checked against W&B's own schema and for what a
Hydra program needs, its trials proposed by W&B's own sweep engine (the ``sweeps`` package that the W&B
server runs: grid, random and bayes behave as there), and each trial's command built by the W&B agent's
own code from the file's ``command``."""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from aiayn.config.naming import output_root
from aiayn.errors import DataError, first_line, nesting
from aiayn.experiments.sweeps.state import DEEPEST, FAILED, FINISHED, INTERRUPTED, SweepError, Trial
from aiayn.extras import require
from aiayn.files import read_plain_file
from aiayn.training.metrics import EVALUATION_METRICS

log = logging.getLogger(__name__)

ARGS_MACRO = "${args_no_hyphens}"  # W&B's macro for the parameters as key=value: Hydra's override syntax
METRICS = tuple(f"{stage}/{name}" for stage in ("val", "test") for name in EVALUATION_METRICS)
SWEEP_FILE_BYTES = 1 << 20  # a sweep file is a page of YAML


def load_sweep(path: Path) -> dict[str, Any]:
    """A W&B sweep file, checked against W&B's own schema and for what a Hydra program needs: the
    parameters passed as overrides through ``${args_no_hyphens}``, and no YAML ``null`` values (W&B
    passes them as the string ``None``; write ``"null"``)."""
    engine = _sweeps()  # first: without it nothing here runs
    from jsonschema import ValidationError  # the engine's own dependency

    path = Path(path)
    try:
        config = yaml.safe_load(read_plain_file(path, SWEEP_FILE_BYTES, follow_links=True))
    except DataError as error:  # not a plain file, or larger than a sweep file
        raise SweepError(str(error)) from None
    except (OSError, yaml.YAMLError, RecursionError) as error:  # RecursionError: nested too deeply
        problem = getattr(error, "problem", None) or first_line(error)  # YAML: what is wrong, and where
        where = getattr(error, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
        raise SweepError(f"{path}: cannot read the sweep file: {problem}{at}") from None
    if not isinstance(config, dict):
        raise SweepError(f"{path}: a sweep file is a YAML mapping with method, parameters and command")
    if nesting(config) > DEEPEST:
        raise SweepError(f"{path}: nested deeper than {DEEPEST} levels; a sweep file's parameters nest a few")
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
        return require("sweeps", "sweep", "W&B's sweep engine")


def _plain(value: Any) -> Any:
    """numpy scalars (random and bayes draw them) as the Python values JSON and the command expect."""
    return value.item() if hasattr(value, "item") else value


def propose(config: dict[str, Any], trials: Sequence[Trial], n: int = 1) -> list[dict[str, Any]]:
    """Up to ``n`` new parameter sets, as a W&B server would propose them given ``trials``: grid goes
    through every combination once, random draws, bayes fits the metric of the finished trials."""
    engine = _sweeps()
    runs = [sweep_run(engine, config, trial) for trial in trials]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        proposals = engine.next_runs(config, runs, validate=False, n=n)
    return [{key: _plain(spec["value"]) for key, spec in run.config.items()} for run in proposals if run is not None]


def sweep_run(engine: Any, config: dict[str, Any], trial: Trial) -> Any:
    """``trial`` as the sweep engine sees a W&B run: its state, its parameters and its metric."""
    # an interrupted trial runs again: to bayes it is under way ("preempted"), not a failure to avoid
    state = {FINISHED: "finished", FAILED: "failed", INTERRUPTED: "preempted"}.get(trial.state, "running")
    metric = config.get("metric", {}).get("name")
    summary = {metric: trial.metric} if metric and trial.metric is not None else {}
    return engine.SweepRun(
        name=trial.name,
        state=state,
        config={key: {"value": value} for key, value in trial.params.items()},
        summary_metrics=summary,
    )


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


def default_folder(config: dict[str, Any], source: Path) -> Path:
    """``<output root>/sweeps/<the file's name: key, else its file name>`` (the output root:
    ``$AIAYN_OUTPUT``, else ``outputs``); a name that is not one plain folder name
    (``../x``, ``/x``, ``a/b``, ``.``, empty) would put the sweep and its trials somewhere else."""
    name = str(Path(source).stem if config.get("name") is None else config["name"])
    if name in ("", "..") or Path(name).name != name:
        raise SweepError(
            f"{source}: name: {name!r} is not a folder name (the sweep's folder is outputs/sweeps/<name>); "
            "use a plain name, without / or .., or pass --dir <folder>"
        )
    return Path(output_root()) / "sweeps" / name


def trial_count(config: dict[str, Any], count: int | None, source: Path) -> int | None:
    """How many trials the sweep holds in all: ``count``, else the file's ``run_cap``, else (grid) every
    combination; random and bayes never end by themselves."""
    count = count or config.get("run_cap")
    if count is None and config["method"] != "grid":
        raise SweepError(f"{source}: a {config['method']} sweep never ends; pass --count N or set run_cap: N")
    return count
