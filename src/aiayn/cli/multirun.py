"""How a job of a Hydra multirun (``aiayn-train -m ...``) runs inside the process that launches them.

Hydra's basic launcher runs the jobs one after another in this process. Two things then break a job
that trains with DDP, and :func:`one_job` mends both:

- Lightning starts the other ranks by running the command again (``sys.argv``), which for a multirun
  is the whole sweep: the second rank would start a multirun of its own in another folder, and rank 0
  would wait for it for the collective timeout (3 hours with ``hardware=gpu8_ddp``). While a job runs,
  ``sys.argv`` is this job alone (its own overrides, Hydra's, the config flags) and ``hydra.run.dir``
  its folder, so the ranks compose this job and write into its folder.
- Lightning leaves its launcher's environment (``LOCAL_RANK``, ``MASTER_PORT``, ``WORLD_SIZE``...) and
  the process group behind: the next job would believe its ranks were started elsewhere and wait for
  them. After a job, its ranks have ended, the process group is gone and the environment is restored.

Launchers that run a job in a process of their own (joblib, submitit's local processes) cannot give
Lightning a command to run again: :func:`check_launcher` refuses them for DDP jobs before any work.
SLURM's launcher starts every rank as a task of the job, so Lightning starts none.

Hydra's sweepers (Optuna, Ax, Nevergrad) choose the next trial from the value a job returns:
:func:`sweeper_value`.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytorch_lightning as pl
import torch
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict, read_write

from aiayn.config.build import config_keys
from aiayn.errors import ConfigError, first_line
from aiayn.machine import Devices

log = logging.getLogger(__name__)

BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
# What the job's ranks must not inherit from the multirun's command: the sweep, how jobs are launched,
# and what Lightning sets itself when it starts the ranks (hydra.run.dir, hydra.job.name, hydra.output_subdir).
NOT_FOR_RANKS = (
    "hydra.mode", "hydra.sweep", "hydra.sweeper", "hydra/sweeper", "hydra.launcher", "hydra/launcher",
    "hydra.run.dir", "hydra.job.name", "hydra.output_subdir",
)  # fmt: skip
FAILED_JOB_GRACE = 60.0  # seconds the other ranks of a job that failed here get to end by themselves
CONFIG_FLAGS = (("config_path", "--config-path"), ("config_name", "--config-name"), ("config_dir", "--config-dir"))


def starts_ranks(trainer: DictConfig) -> bool:
    """The run trains with DDP over more than one process (devices × nodes), which Lightning starts itself
    unless a cluster (SLURM, torchrun) started them."""
    strategy = trainer.get("strategy")
    name = str(strategy.get("_target_", "")) if isinstance(strategy, DictConfig) else str(strategy)
    with config_keys("trainer"):  # a bad value: one line naming trainer.devices, not a traceback
        devices = Devices.parse(trainer.get("devices", 1), trainer.get("num_nodes", 1))
    return "ddp" in name.lower() and devices.several


def check_launcher(trainer: DictConfig, hydra_cfg: DictConfig) -> None:
    """Refuse a multirun whose launcher runs each job in a process of its own when the job starts DDP
    ranks: Lightning would run that process's command again, which is not aiayn-train's."""
    target = str(hydra_cfg.launcher.get("_target_", ""))
    if target == BASIC_LAUNCHER or "Slurm" in target or not starts_ranks(trainer):
        return
    raise ConfigError(
        "hydra/launcher",
        hydra_cfg.runtime.choices.get("hydra/launcher") or target,
        "cannot start the DDP ranks of a job (Lightning starts them by running aiayn-train again); use Hydra's "
        "basic launcher (no hydra/launcher override), hardware=slurm, or aiayn-sweep --parallel",
    )


def check_study_storage(hydra_cfg: DictConfig) -> None:
    """Open the database that ``hydra.sweeper.storage`` names for the Optuna search, once, before any
    trial: a URL without its driver, or a file that cannot be written, is refused in one line rather than
    as Optuna's traceback (the sweeper would open it a moment later, creating the same database)."""
    sweeper = hydra_cfg.get("sweeper") or {}
    url = sweeper.get("storage")
    if "optuna" not in str(sweeper.get("_target_", "")).lower() or not url:
        return
    from optuna.storages import get_storage

    try:
        get_storage(url)
    except Exception as error:  # ImportError (a driver), SQLAlchemy's and Optuna's own errors
        raise ConfigError(
            "hydra.sweeper.storage",
            url,
            f"cannot be opened ({first_line(error)}); give a database Optuna can "
            "open, e.g. sqlite:///<a writable path>/optuna.db, or null to keep the study in memory",
        ) from None


def job_command(argv: list[str], hydra_cfg: DictConfig) -> list[str]:
    """The command that runs this job alone: the script, the config flags of ``argv``, Hydra's overrides
    that are not about the sweep, and the job's own overrides (its point of the sweep)."""
    from hydra._internal.utils import get_args_parser  # Hydra's own reading of its command line

    args = get_args_parser().parse_args(argv[1:])
    flags = [
        item
        for attribute, flag in CONFIG_FLAGS
        if getattr(args, attribute)
        for item in (flag, getattr(args, attribute))
    ]
    hydra_overrides = [o for o in hydra_cfg.overrides.hydra if not o.lstrip("+~").startswith(NOT_FOR_RANKS)]
    return [argv[0], *flags, *hydra_overrides, *hydra_cfg.overrides.task]


class JobRanks(pl.Callback):
    """Remembers the processes Lightning's launcher started for this job's other ranks (on rank 0)."""

    def __init__(self) -> None:
        self.processes: list[Any] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.processes = list(getattr(trainer.strategy.launcher, "procs", None) or [])

    def end(self, grace: float | None) -> None:
        """Wait until they have ended: the next job must not start while one of this job's ranks runs (a
        rank that fails makes Lightning end them all). After ``grace`` seconds (the job failed on this
        rank, without which the others cannot finish) they are killed."""
        for process in self.processes:
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def one_job(hydra_cfg: DictConfig) -> Iterator[JobRanks]:
    """Around a multirun's job in the launching process: the DDP ranks Lightning starts run this job
    alone, in its folder, and nothing of the job's ranks stays behind for the next job. Yields the
    callback the job's trainer must have."""
    argv, environment, threads = list(sys.argv), dict(os.environ), torch.get_num_threads()
    sys.argv = job_command(argv, hydra_cfg)
    with read_write(hydra_cfg), open_dict(hydra_cfg):
        hydra_cfg.run.dir = hydra_cfg.runtime.output_dir  # where Lightning sends the ranks
    ranks, grace = JobRanks(), None
    try:
        yield ranks
    except BaseException:
        grace = FAILED_JOB_GRACE
        raise
    finally:
        ranks.end(grace)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # the next job's ranks make their own
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environment)
        torch.set_num_threads(threads)  # Lightning divides the threads among the ranks it starts


@contextmanager
def sweeper_trial(hydra_cfg: DictConfig) -> Iterator[None]:
    """In a trial of one of Hydra's sweepers (Optuna...), a run that fails ends with its one line on stderr
    (its exit status is logged) and the search goes on (the trial is worth the worst value); an
    interrupted one (a signal, 128 + its number) still ends the search."""
    if hydra_cfg.mode != RunMode.MULTIRUN or hydra_cfg.sweeper._target_ == BASIC_SWEEPER:
        yield
        return
    try:
        yield
    except SystemExit as stop:
        if not isinstance(stop.code, int) or stop.code >= 128 or stop.code == 0:
            raise
        log.error("trial %s failed (exit status %d); the search goes on", hydra_cfg.job.num, stop.code)


def sweeper_value(results: dict[str, Any] | None, mode: str) -> float:
    """What a job returns to Hydra's sweeper: the run's best value of ``checkpoint.monitor``; for a run
    that failed (``results`` None) or never validated, the worst value (-inf when the sweeper maximises,
    as ``mode`` max says), so that the search records the trial and goes on rather than ending."""
    score = results.get("best_score") if results else None
    if score is None or not math.isfinite(score):
        return -math.inf if mode == "max" else math.inf
    return float(score)
