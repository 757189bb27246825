"""``aiayn-train``: train a Transformer as the composed config says (see conf/train.yaml)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict, read_write
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from aiayn.cli.common import (
    fail,
    quiet_libraries,
    remove_unstarted_run,
    reported_hydra_errors,
    reported_run_errors,
)
from aiayn.cli.help import exit_with_help_if_asked
from aiayn.config.compose import config_dir
from aiayn.config.naming import RUN_DIR_ENV
from aiayn.config.run_folder import dashboard_group, named_by_user
from aiayn.errors import ConfigError, DataError, RunFolderBusy
from aiayn.files import held_folders, hold_run_folder, release_run_folder
from aiayn.machine import process_rank, retain_freed_memory

log = logging.getLogger(__name__)


def main() -> None:
    """The console script: :func:`run`, with errors a user can act on reported in one line. The folders
    it held are given up when it ends, however it ends (it may run inside a longer process: a test, a
    notebook)."""
    exit_with_help_if_asked("aiayn-train", "train", multirun=True)
    quiet_libraries()
    before = held_folders()
    try:
        with reported_hydra_errors("aiayn-train"):
            try:
                run()
            except InterpolationResolutionError as error:
                # A multirun's job folder is held as Hydra resolves its name (aiayn.config.naming.job_dir).
                cause = folder_error(error)
                if cause is None:
                    raise
                fail("aiayn-train", cause, 2)
    finally:
        for folder in held_folders() - before:
            release_run_folder(folder)


@hydra.main(config_path=config_dir(), config_name="train", version_base="1.3")
def run(cfg: DictConfig) -> float:
    """Train one run (or one job of a multirun); the run's best value of ``checkpoint.monitor``, which
    Hydra's sweepers (``hparams_search=...``) optimise, is returned."""
    # Lightning and the model are imported for the work: --help and Hydra's errors come at once.
    from aiayn.cli.multirun import check_launcher, one_job, sweeper_trial, sweeper_value
    from aiayn.config.preflight import check_multirun_resume
    from aiayn.experiments.run import train

    if not retain_freed_memory():
        log.info("glibc allocator thresholds not set (not glibc): large tensors will be mmapped per step")
    hydra_cfg = HydraConfig.get()
    in_job = os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_EXECUTOR")  # an aiayn-sweep trial's job
    if hydra_cfg.mode != RunMode.MULTIRUN and hydra_cfg.launcher._target_.endswith("SlurmLauncher") and not in_job:
        # Without -m Hydra ignores the launcher: the run would start here, on the login node.
        print(
            "hardware=slurm submits jobs through Hydra's launcher: add -m (aiayn-train -m hardware=slurm ...)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    run_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    # A folder named by the user (hydra.run.dir=..., a sweep's trial folder) is never removed on errors.
    named = named_by_user(hydra_cfg, "run") or multirun  # a job's: <sweep>/<job number>
    again = f"hydra.sweep.dir={hydra_cfg.sweep.dir}" if multirun and not os.environ.get(RUN_DIR_ENV) else ""
    results = None
    with contextlib.ExitStack() as job:
        # A multirun's job: its DDP ranks run this job alone, and leave nothing behind for the next job.
        callbacks = [job.enter_context(one_job(hydra_cfg))] if multirun else []
        with sweeper_trial(hydra_cfg), reported_run_errors("aiayn-train", run_dir, created=not named, again=again):
            check_multirun_resume(cfg.resume, cfg.sweep_dir, multirun=multirun)
            if multirun:
                check_launcher(cfg.trainer, hydra_cfg)
            results = train(cfg, run_dir, list(hydra_cfg.overrides.task), dashboard_group(cfg), callbacks)
    if results is not None and process_rank() == 0:  # under DDP every rank runs this; one summary is enough
        print(json.dumps(results))
    return sweeper_value(results, cfg.checkpoint.mode)


class RunFolderLock(Callback):
    """Makes this process the one writer of the run's folder (:func:`aiayn.files.hold_run_folder`) as
    soon as Hydra has chosen it, before Hydra writes ``.hydra/`` into it: a second ``aiayn-train`` in a
    folder that a living run writes stops here, with exit status 2, and changes nothing in it; so does a
    folder with a link, a FIFO or a device anywhere in it, and ``resume=`` that names nothing to
    continue. The run's own lock in :func:`~aiayn.experiments.run.train` is then this one.

    A multirun (``-m``) holds its own folder likewise, before Hydra writes ``multirun.yaml`` there; each
    job's folder is held as Hydra chooses it (:func:`aiayn.config.naming.job_dir`) and given up here when
    the job ends (the next jobs may run for hours: the finished one can be continued meanwhile).

    Hydra turns a callback's exception into a warning and goes on writing into the folder, so every
    error ends the command here (:func:`stopping_errors`)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        with stopping_errors():
            if process_rank() != 0 and config.hydra.output_subdir is not None:  # Lightning's ranks: None
                self._other_rank(config)
            folder = self._hold(config, "run")
            if folder is not None:
                self._check_resume(config, folder)

    @staticmethod
    def _other_rank(config: DictConfig) -> None:
        """A rank that ``torchrun`` or ``srun`` started shares the first rank's folder: it writes no
        ``.hydra/`` there and logs to a file of its own, as the ranks Lightning starts do."""
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.output_subdir = None
            config.hydra.job.name = f"{config.hydra.job.name}_rank{process_rank()}"

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from aiayn.cli.multirun import check_launcher, check_study_storage

        with stopping_errors():
            # Before any job: a launcher that cannot start DDP ranks (each job checks its own config too).
            check_launcher(config.trainer, config.hydra)
            check_study_storage(config.hydra)
            self._hold(config, "sweep")

    def on_job_end(self, config: DictConfig, **kwargs: Any) -> None:
        with stopping_errors():
            if config.hydra.mode == RunMode.MULTIRUN and process_rank() == 0:
                release_run_folder(Path(config.hydra.runtime.output_dir))

    @staticmethod
    def _hold(config: DictConfig, node: str) -> Path | None:
        """Hold ``hydra.<node>.dir``, which is returned (None in a DDP rank other than the first, and when
        the name cannot be resolved yet). Whatever stops it removes the folder when this command reserved
        it and it is still empty (:func:`~aiayn.cli.common.remove_unstarted_run`)."""
        if process_rank() != 0:  # a DDP rank that Lightning started: the first rank holds the folder
            return None
        HydraConfig.instance().set_config(config)  # the folder's name reads the runtime choices
        try:
            folder = Path(config.hydra[node].dir)
        except OmegaConfBaseException:
            return None  # a setting in the name that cannot be resolved: Hydra reports it in a moment
        try:
            hold_run_folder(folder)
        except BaseException as error:
            if not isinstance(error, RunFolderBusy) and not named_by_user(config.hydra, node):
                remove_unstarted_run(folder)
            raise
        return folder

    @staticmethod
    def _check_resume(config: DictConfig, folder: Path) -> None:
        """``resume=`` names something to continue, or nothing (:func:`requested_checkpoint`): refused here,
        before the tokenizer, the data and the dashboard's run, and before Hydra writes into the folder."""
        from aiayn.experiments.resume import requested_checkpoint

        try:
            requested = config.resume
        except OmegaConfBaseException:
            return  # reported with the rest of the config
        try:
            requested_checkpoint(requested, folder)
        except ConfigError:
            if not named_by_user(config.hydra, "run"):
                release_run_folder(folder)
                remove_unstarted_run(folder)
            raise


@contextlib.contextmanager
def stopping_errors() -> Iterator[None]:
    """Around a Hydra callback's work: an error a user can act on ends the command in one line with exit
    status 2, anything else with its traceback, named as a bug of aiayn, and status 1. Never the
    warning Hydra would make of it."""
    try:
        yield
    except (RunFolderBusy, DataError, ConfigError, OSError) as error:
        fail("aiayn-train", error, 2)
    except Exception:
        traceback.print_exc()
        fail("aiayn-train", "a bug in aiayn stopped the run before it started (traceback above); please report it", 1)


def folder_error(error: BaseException | None) -> RunFolderBusy | DataError | None:
    """The :class:`RunFolderBusy` or :class:`DataError` (no locks) behind a resolver's error, if any."""
    while error is not None and not isinstance(error, RunFolderBusy | DataError):
        error = error.__cause__ or error.__context__
    return error


if __name__ == "__main__":
    main()
