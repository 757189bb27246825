"""One trial's life: its environment and run folder, its config composed as ``aiayn-train`` composes it,
its start (a process here, or a submitted job), and how it ended (finished with its metric, or failed)."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from aiayn.config.naming import RUN_DIR_ENV, SWEEP_DIR_ENV, run_label
from aiayn.errors import DataError
from aiayn.experiments.sweeps.file import command_overrides
from aiayn.experiments.sweeps.launchers import SubmititLauncher, TrialHandle, TrialJob, start_process
from aiayn.experiments.sweeps.state import FAILED, FINISHED, LOCAL, RUNNING, SweepError, SweepState, Trial
from aiayn.extras import missing_hydra_plugin
from aiayn.files import atomic_write, own_folder
from aiayn.machine import available_cpus
from aiayn.training.metrics import METRICS_CSV, metric_rows

log = logging.getLogger(__name__)

FOREIGN_VARIABLES = ("WANDB_RUN_ID", "WANDB_SWEEP_ID", "WANDB_RESUME", "WANDB_RUN_GROUP")  # a surrounding W&B run's


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


class NotComposed(ValueError):
    """A trial whose overrides do not compose; ``reason`` is the first line of Hydra's."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"its overrides do not compose: {reason}")


def compose_trial(command: Sequence[str]) -> Any:
    """The trial's training config with Hydra's node (its launcher settings), composed from the command's
    overrides as ``aiayn-train`` composes it: what the runner places and submits, and what ``--dry-run``
    checks; :class:`NotComposed` when it does not compose."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from aiayn.config.compose import compose_config

    try:
        return compose_config("train", command_overrides(command))
    except (HydraException, OmegaConfBaseException) as error:
        raise NotComposed(str(missing_hydra_plugin(error) or error).splitlines()[0]) from None  # hardware=slurm


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
    logs = own_folder(state.folder / "logs")
    # As `wandb agent` does: the trial's parameters in W&B's format, named by $WANDB_SWEEP_PARAM_PATH
    # (W&B records them in the run's config).
    params = logs / f"{trial.name}.params.yaml"
    atomic_write(params, yaml.safe_dump({key: {"value": value} for key, value in trial.params.items()}))
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
