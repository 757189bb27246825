"""``aiayn-train``: train a Transformer as the composed config says (see conf/train.yaml)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from pytorch_lightning.utilities import rank_zero_only

from aiayn.cli.common import reported_hydra_errors, reported_run_errors
from aiayn.config.compose import config_dir
from aiayn.config.naming import RUN_DIR_ENV
from aiayn.errors import ConfigError
from aiayn.experiments.run import train
from aiayn.training.allocator import retain_freed_memory

log = logging.getLogger(__name__)


def main() -> None:
    """The console script: :func:`run`, with errors a user can act on reported in one line."""
    with reported_hydra_errors("aiayn-train"):
        run()


@hydra.main(config_path=config_dir(), config_name="train", version_base="1.3")
def run(cfg: DictConfig) -> None:
    if not retain_freed_memory():
        log.info("glibc allocator thresholds not set (not glibc): large tensors will be mmapped per step")
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN and hydra_cfg.launcher._target_.endswith("SlurmLauncher"):
        # Without -m Hydra ignores the launcher: the run would start here, on the login node.
        print(
            "hardware=slurm submits jobs through Hydra's launcher: add -m (aiayn-train -m hardware=slurm ...)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    run_dir = Path(hydra_cfg.runtime.output_dir)
    # A folder named by the user (hydra.run.dir=..., a sweep's trial folder) is never removed on errors.
    named = any(o.startswith("hydra.run.dir=") for o in hydra_cfg.overrides.hydra) or bool(os.environ.get(RUN_DIR_ENV))
    with reported_run_errors("aiayn-train", run_dir, created=not named):
        if hydra_cfg.mode == RunMode.MULTIRUN and cfg.resume is True and not cfg.sweep_dir:
            allowed = "continues one run: drop -m (a multirun's jobs continue in their folders when it runs again "
            raise ConfigError("resume", True, allowed + "with the same hydra.sweep.dir)")
        results = train(cfg, run_dir, list(hydra_cfg.overrides.task), dashboard_group(cfg))
    if rank_zero_only.rank == 0:  # under DDP every rank runs this; one summary is enough
        print(json.dumps(results))


def dashboard_group(cfg: DictConfig) -> str | None:
    """A sweep's trials share ``sweep/<its folder>``; the jobs of one multirun ``multirun/<its start time>``."""
    if cfg.sweep_dir:
        return f"sweep/{Path(cfg.sweep_dir).name}"
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return f"multirun/{Path(HydraConfig.get().sweep.dir).name}"
    return None


if __name__ == "__main__":
    main()
