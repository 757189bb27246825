"""Where a sweep's trials run: as processes of the runner's machine (``local``), or each as a job of its
own through submitit: on SLURM (``slurm``), or through submitit's local executor (``submitit-local``),
which runs the same jobs as local processes through the same API (what the tests use).

A submitted trial runs :class:`TrialJob` on its node: the trial's command as a child process, its output
appended to the sweep's ``logs/<trial>.log``, its exit status written to ``logs/<trial>.exit.json``. At
submitit's preemption or time-limit signal (SIGUSR2, ``signal_delay_s`` before the limit) the job passes
the signal on to the trial, which saves ``checkpoints/last.ckpt`` and exits, and asks submitit to requeue
it: the requeued job runs the same command in the same run folder, which continues from that checkpoint.

The runner never unpickles what a job left (submitit's result files): it reads the job's state from
SLURM (``sacct``, through submitit's watcher) or from the local controller's process, the exit status
from the JSON file, the trial's metric from its run folder. So a runner started again re-attaches to the
jobs recorded in ``sweep.json`` by their ids instead of submitting them again.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig, OmegaConf

from aiayn.errors import DataError
from aiayn.experiments.sweeps.state import JOB_ID, SLURM, SUBMITIT_FOLDER, SUBMITIT_LOCAL
from aiayn.files import atomic_write, open_for_append, read_plain_file

log = logging.getLogger(__name__)

# hydra-submitit-launcher's generic settings (submitit's AutoExecutor takes them as they are); the others
# of hardware=slurm's hydra.launcher are SLURM's own (AutoExecutor's slurm_<name>).
GENERIC_SETTINGS = (
    "timeout_min",
    "cpus_per_task",
    "gpus_per_node",
    "tasks_per_node",
    "mem_gb",
    "nodes",
    "stderr_to_stdout",
)
NOT_EXECUTOR_SETTINGS = ("_target_", "submitit_folder", "name", "max_num_timeout", "array_parallelism")
NO_EXIT_STATUS = -1  # a job that ended without writing one: cancelled, killed, or it never started
EXIT_FILE_BYTES = 1 << 16  # a job writes {"returncode": <status>} there
# A trial that saved last.ckpt at a signal and stopped (aiayn-train exits with 128 + the signal's number).
STOPPED_STATUSES = tuple(128 + signum for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2))
# SLURM's states of a job that has not ended or is about to run again (submitit's watcher reads them from
# sacct; PREEMPTED, as submitit counts it, since a preempted job is usually requeued); the local
# controller's: RUNNING. UNKNOWN: sacct does not know the job yet, right after its submission.
ACTIVE_STATES = (
    "RUNNING", "PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING", "SUSPENDED",
    "RESIZING", "PREEMPTED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "UNKNOWN",
)  # fmt: skip


class TrialHandle(Protocol):
    """A started trial, as the runner watches it."""

    @property
    def job_id(self) -> str:
        """The process id, or the scheduler's job id."""

    @property
    def detaches(self) -> bool:
        """True: a stopping runner leaves it running, and a runner started again re-attaches to it."""

    def poll(self) -> int | None:
        """The trial's exit status once it has ended (:data:`NO_EXIT_STATUS` when it left none), else None."""

    def state(self) -> str:
        """What its scheduler says of it: RUNNING, PENDING, ..."""


@dataclass
class TrialProcess:
    """A trial the runner started as its own child, in a process group (and session) of its own, so that
    a terminal's Ctrl-C reaches the runner alone and the runner can stop the trial with its workers."""

    process: subprocess.Popen[bytes]
    detaches: bool = False

    @property
    def job_id(self) -> str:
        return str(self.process.pid)

    def poll(self) -> int | None:
        return self.process.poll()

    def state(self) -> str:
        return "RUNNING" if self.process.poll() is None else "ENDED"

    def signal(self, signum: int) -> None:
        if self.process.returncode is None:  # not yet reaped: its pid, and so its group, is still its own
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signum)

    def wait(self, timeout: float | None) -> int:
        return self.process.wait(timeout=timeout)


def start_process(command: Sequence[str], env: dict[str, str], log_file: Path) -> TrialProcess:
    """Start ``command`` as a trial of the local launcher, its output appended to ``log_file``."""
    with open_for_append(log_file) as output:
        process = subprocess.Popen(
            list(command), stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return TrialProcess(process)


@dataclass
class TrialJob:
    """What a submitted job runs on its node (submitit pickles it there): the trial's command, with the
    trial's own environment variables added to the node's and ``unset`` removed from it."""

    command: list[str]
    env: dict[str, str]
    unset: list[str]
    log_file: str
    exit_file: str
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)
    _ended: threading.Event | None = field(default=None, repr=False, compare=False)

    def __call__(self) -> int:
        if job_rank() == 0:  # a requeued job runs again: an earlier attempt's status is not this one's
            Path(self.exit_file).unlink(missing_ok=True)
        with open_for_append(Path(self.log_file)) as output:
            process = subprocess.Popen(self.command, stdout=output, stderr=subprocess.STDOUT, env=self.environment())
        self._process, self._ended = process, threading.Event()
        # A thread waits for the child, the main thread for the thread: submitit's signal handler runs in
        # the main thread and must be able to wait for the child too (Popen.wait holds a lock meanwhile).
        waiter = threading.Thread(target=lambda: (process.wait(), self._ended.set()), daemon=True)  # type: ignore[union-attr]
        waiter.start()
        self._ended.wait()
        if job_rank() == 0:
            atomic_write(Path(self.exit_file), json.dumps({"returncode": process.returncode}) + "\n")
        return process.returncode

    def environment(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if key not in self.unset}
        return {**env, **self.env}

    def checkpoint(self) -> Any | None:
        """submitit's hook at a preemption or time-limit notice (rank 0 only): the trial saves its last
        checkpoint and exits (SIGUSR2, see :mod:`aiayn.training.callbacks.preemption`), then the job is
        requeued with the same command."""
        from submitit.helpers import DelayedSubmission

        if self._process is None or self._ended is None or self._ended.is_set():
            return None  # the trial has ended (or not begun): nothing to continue, no requeue
        with suppress(ProcessLookupError):
            self._process.send_signal(signal.SIGUSR2)
        self._ended.wait()
        return DelayedSubmission(TrialJob(self.command, self.env, self.unset, self.log_file, self.exit_file))

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key not in ("_process", "_ended")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _process=None, _ended=None)


def job_rank() -> int:
    """This task's global rank in its submitit job (0 outside one)."""
    import submitit

    try:
        return submitit.JobEnvironment().global_rank
    except RuntimeError:
        return 0


def read_exit_file(path: Path) -> int | None:
    """The exit status a job wrote, or None (none written, or not a number: never trusted further; nor a
    file that is not plain, larger than :data:`EXIT_FILE_BYTES` or nested too deeply to parse)."""
    try:
        status = json.loads(read_plain_file(path, EXIT_FILE_BYTES)).get("returncode")
    except (DataError, OSError, ValueError, RecursionError, AttributeError):
        return None
    return status if isinstance(status, int) and not isinstance(status, bool) else None


@dataclass
class SubmittedTrial:
    """A trial submitted as a submitit job, watched through its id."""

    kind: str
    job: Any  # submitit.Job
    exit_file: Path
    detaches: bool = True

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    def state(self) -> str:
        if self.kind == SUBMITIT_LOCAL and getattr(self.job, "_process", None) is None:
            return "RUNNING" if local_controller_alive(self.job_id) else "ENDED"  # re-attached: not our child
        return str(self.job.state).split()[0].upper()

    def poll(self) -> int | None:
        if self.state() in ACTIVE_STATES:
            return None
        status = read_exit_file(self.exit_file)
        return NO_EXIT_STATUS if status is None else status


def refresh_slurm_states() -> None:
    """Ask SLURM (one ``sacct`` for every job watched) now: submitit's watcher would otherwise answer
    from what it read up to 10 minutes ago once no job was submitted for a while."""
    import submitit

    submitit.SlurmJob.watcher.update()


def local_controller_alive(pid: str) -> bool:
    """Whether submitit's local controller of job ``pid`` still runs (a runner started again is not its
    parent): a process of that id running ``submitit.local._local``."""
    try:
        command = Path(f"/proc/{int(pid)}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False
    return b"submitit.local._local" in command


def executor_settings(launcher: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """submitit's AutoExecutor arguments and parameters from a trial's composed ``hydra.launcher``
    (``hardware=slurm``'s: partition, account, time, GPUs per node, requeues ...), as Hydra's submitit
    launcher passes them. Only these are resolved (``name`` and the folder need Hydra's runtime)."""
    settings = {key: launcher[key] for key in launcher if key not in NOT_EXECUTOR_SETTINGS}
    settings = {key: OmegaConf.to_container(v) if isinstance(v, DictConfig) else v for key, v in settings.items()}
    timeouts = launcher.get("max_num_timeout", 3)
    init = {f"{SLURM}_max_num_timeout": timeouts, "local_max_num_timeout": timeouts}
    parameters = {
        (key if key in GENERIC_SETTINGS else f"{SLURM}_{key}"): value
        for key, value in settings.items()
        if value not in (None, {}, [])
    }
    return init, parameters


class SubmititLauncher:
    """Submits each trial as a job through submitit's ``slurm`` or ``local`` executor, into
    ``<sweep>/.submitit/<job id>/``."""

    def __init__(self, kind: str, sweep_folder: Path) -> None:
        self.kind = kind
        self.folder = sweep_folder / SUBMITIT_FOLDER / "%j"

    def submit(self, name: str, job: TrialJob, launcher: DictConfig) -> SubmittedTrial:
        import submitit

        if "submitit" not in str(launcher.get("_target_", "")):
            raise ValueError(
                f"--launcher {self.kind} takes its job settings from hardware=slurm (hydra.launcher: partition, "
                "account, time, GPUs per node); add hardware=slurm to the sweep file's command"
            )
        init, parameters = executor_settings(launcher)
        cluster = "local" if self.kind == SUBMITIT_LOCAL else SLURM
        if cluster == "local":  # one task: on one machine Lightning starts a trial's DDP processes itself
            parameters["tasks_per_node"] = 1
        executor = submitit.AutoExecutor(folder=self.folder, cluster=cluster, **init)
        executor.update_parameters(name=name, **parameters)
        Path(job.exit_file).unlink(missing_ok=True)  # an earlier attempt's
        submitted = executor.submit(job)
        return SubmittedTrial(self.kind, submitted, Path(job.exit_file))

    def attach(self, job_id: str, exit_file: Path) -> SubmittedTrial:
        """The job ``job_id`` a runner before this one submitted (as ``sweep.json`` says: checked)."""
        import submitit

        if not JOB_ID.fullmatch(job_id):
            raise ValueError(f"job_id {job_id!r} is not a job id; sweep.json was changed by hand?")
        from submitit.local.local import LocalJob

        job = LocalJob(self.folder, job_id) if self.kind == SUBMITIT_LOCAL else submitit.SlurmJob(self.folder, job_id)
        return SubmittedTrial(self.kind, job, exit_file)
