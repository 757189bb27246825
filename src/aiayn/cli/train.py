"""``aiayn-train``: train a Transformer as the composed config says (see conf/train.yaml)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException
from pytorch_lightning.utilities import rank_zero_only

from aiayn.cli.common import fail, quiet_libraries, reported_hydra_errors, reported_run_errors
from aiayn.config.compose import config_dir
from aiayn.config.naming import RUN_DIR_ENV
from aiayn.errors import ConfigError, RunFolderBusy
from aiayn.experiments.run import train
from aiayn.files import hold_run_folder, release_run_folder
from aiayn.training.allocator import retain_freed_memory

log = logging.getLogger(__name__)


def main() -> None:
    """The console script: :func:`run`, with errors a user can act on reported in one line."""
    quiet_libraries()
    with reported_hydra_errors("aiayn-train"):
        run()


@hydra.main(config_path=config_dir(), config_name="train", version_base="1.3")
def run(cfg: DictConfig) -> None:
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
    # A folder named by the user (hydra.run.dir=..., a sweep's trial folder) is never removed on errors.
    named = (
        any(o.startswith("hydra.run.dir=") for o in hydra_cfg.overrides.hydra)
        or bool(os.environ.get(RUN_DIR_ENV))
        or hydra_cfg.mode == RunMode.MULTIRUN  # a job's folder: <hydra.sweep.dir>/<job number>
    )
    multirun = hydra_cfg.mode == RunMode.MULTIRUN and not os.environ.get(RUN_DIR_ENV)
    again = f"hydra.sweep.dir={hydra_cfg.sweep.dir}" if multirun else ""
    with reported_run_errors("aiayn-train", run_dir, created=not named, again=again):
        if hydra_cfg.mode == RunMode.MULTIRUN and cfg.resume is True and not cfg.sweep_dir:
            allowed = "continues one run: drop -m (a multirun's jobs continue in their folders when it runs again "
            raise ConfigError("resume", True, allowed + "with the same hydra.sweep.dir)")
        results = train(cfg, run_dir, list(hydra_cfg.overrides.task), dashboard_group(cfg))
    if rank_zero_only.rank == 0:  # under DDP every rank runs this; one summary is enough
        print(json.dumps(results))


class RunFolderLock(Callback):
    """Makes this process the one writer of the run's folder (:func:`aiayn.files.hold_run_folder`) as
    soon as Hydra has chosen it, before Hydra writes ``.hydra/`` into it: a second ``aiayn-train`` in a
    folder that a living run writes stops here, with exit status 2, and changes nothing in it. The
    run's own lock in :func:`~aiayn.experiments.run.train` is then this one. A multirun's jobs (whose
    folders Hydra chooses later) take theirs there."""

    def __init__(self) -> None:
        self.held: Path | None = None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if rank_zero_only.rank != 0:  # a DDP rank that Lightning started: the first rank holds the folder
            return
        HydraConfig.instance().set_config(config)  # the folder's name reads the runtime choices
        try:
            folder = Path(config.hydra.run.dir)
        except OmegaConfBaseException:
            return  # a setting in the name that cannot be resolved: Hydra reports it in a moment
        try:
            self.held = folder if hold_run_folder(folder) else None
        except RunFolderBusy as error:
            fail("aiayn-train", error, 2)

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.held:  # the run ended inside a longer process (a test, a notebook)
            release_run_folder(self.held)


def dashboard_group(cfg: DictConfig) -> str | None:
    """A sweep's trials share ``sweep/<its folder>``; the jobs of one multirun ``multirun/<its start time>``."""
    if cfg.sweep_dir:
        return f"sweep/{Path(cfg.sweep_dir).name}"
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return f"multirun/{Path(HydraConfig.get().sweep.dir).name}"
    return None


if __name__ == "__main__":
    main()
