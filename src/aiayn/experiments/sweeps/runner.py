"""The runner: a sweep's trials, ``parallel`` at a time, until the sweep has its count; one runner per
sweep folder; SIGINT and SIGTERM stop its trials gently and are recorded (see :mod:`aiayn.experiments.sweeps`)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiayn.experiments.sweeps.file import (
    default_folder,
    load_sweep,
    propose,
    trial_command,
    trial_count,
    with_overrides,
)
from aiayn.experiments.sweeps.launchers import (
    NO_EXIT_STATUS,
    STOPPED_STATUSES,
    SubmititLauncher,
    TrialHandle,
    TrialProcess,
    refresh_slurm_states,
)
from aiayn.experiments.sweeps.placement import DevicePool, PlacementError, devices_needed, runner_devices
from aiayn.experiments.sweeps.state import (
    FAILED,
    FINISHED,
    INTERRUPTED,
    LAUNCHERS,
    LOCAL,
    RUNNING,
    SLURM,
    STATE_FILE,
    SUBMITIT_FOLDER,
    SweepError,
    SweepState,
    Trial,
)
from aiayn.experiments.sweeps.trial import (
    compose_trial,
    exit_file,
    finish_trial,
    start_trial,
    take_results,
    trial_environment,
    trial_folder,
)
from aiayn.extras import require
from aiayn.files import refuse_links, run_folder_holder

log = logging.getLogger(__name__)

STOP_SECONDS = 60  # stopped trials' time to save last.ckpt, end cleanly and flush W&B before they are killed
POLL_SECONDS = 0.2  # how often the runner looks at its trials and at the run folders it waits for
JOB_POLL_SECONDS = 10.0  # how often it asks SLURM about submitted jobs (sacct is not to be hammered)


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
    at a time, where ``launcher`` says (:mod:`.launchers`), each trial's command ending
    with ``overrides`` (:func:`with_overrides`); returns the sweep's state (its folder, every trial). A
    trial that fails is recorded and the others go on."""
    if parallel < 1:
        raise SweepError(f"--parallel {parallel}: run at least one trial at a time")
    if launcher not in LAUNCHERS:
        raise SweepError(f"--launcher {launcher}: use one of {', '.join(LAUNCHERS)}")
    if launcher != LOCAL:  # said before anything starts, not as the first trial's failure
        require("submitit", "sweep", f"submitit (--launcher {launcher})")
    config = with_overrides(load_sweep(source), overrides)
    folder = Path(folder or default_folder(config, source)).resolve()
    total = trial_count(config, count, source)
    folder.mkdir(parents=True, exist_ok=True)
    with exclusive(folder):
        refuse_links(folder)  # a shared folder's links would take the trials' writes elsewhere
        state = SweepState.open(folder, config, source)
        state.save()
        run_trials(state, total, parallel, report, launcher)
    return state


@contextmanager
def exclusive(folder: Path) -> Iterator[None]:
    """One runner per sweep folder: a second would start the same trials in the same run folders."""
    path = folder / ".lock"
    try:
        lock = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as error:
        why = "is a link" if error.errno == errno.ELOOP else f"cannot be opened ({error.strerror})"
        raise SweepError(f"{path}: {why}; remove it (or run the sweep in another folder)") from None
    try:
        if not stat.S_ISREG(os.fstat(lock).st_mode):
            raise SweepError(f"{path}: is not a plain file; remove it (or run the sweep in another folder)")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SweepError(f"another aiayn-sweep is running in {folder}; wait for it or stop it") from None
        yield
    finally:
        os.close(lock)


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
