"""Ending a run's loggers when the run ends, whether it failed or not."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pytorch_lightning.loggers import Logger

from aiayn.training.loggers.tensorboard_logger import TensorBoardRunLogger
from aiayn.training.loggers.wandb_logger import WandbRunLogger

log = logging.getLogger(__name__)


def finish_loggers(loggers: Sequence[Logger], failed: bool, summary: dict[str, Any] | None = None) -> None:
    """Writes ``summary`` (the run's results) to the W&B runs and finishes them; CSV files are flushed.
    A logger that fails here is reported, not raised: it must not hide why the run failed."""
    for logger in loggers:
        try:
            if isinstance(logger, WandbRunLogger):
                logger.finish(failed, summary)
            elif isinstance(logger, TensorBoardRunLogger):
                logger.close("failed" if failed else "success")
            else:
                logger.finalize("failed" if failed else "success")
        except Exception:
            log.exception("could not finish the %s logger", type(logger).__name__)
