"""The run's loggers: CSV always, plus the dashboard the ``logger`` config group picks (W&B by default).

W&B runs online when the user is logged in and offline into the run folder otherwise, so a run without
an account or a network records everything too; ``wandb sync`` uploads it later.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import netrc
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.loggers.logger import rank_zero_experiment
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from aiayn.errors import ConfigError
from aiayn.files import atomic_write
from aiayn.machine import device_name, matmul_precision
from aiayn.model import count_parameters

log = logging.getLogger(__name__)

WANDB_MODES = ("auto", "online", "offline", "disabled")
METRICS_CSV = Path("csv") / "metrics.csv"  # in a run folder: what build_loggers' CSV logger writes
META_KEY = "aiayn"  # the dashboard config's entry for what the composed config does not hold


def wandb_credentials() -> str | None:
    """Where W&B would find credentials for its server, or None: ``WANDB_API_KEY``, an identity token
    file, W&B's settings, or the netrc entry ``wandb login`` writes for the server's host and port."""
    import wandb

    if os.environ.get("WANDB_API_KEY"):
        return "WANDB_API_KEY"
    if os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "WANDB_IDENTITY_TOKEN_FILE"
    settings = wandb.setup().settings  # the environment and W&B's settings files (`wandb login --host`)
    if settings.api_key:
        return "W&B settings"
    path = os.environ.get("NETRC") or next(
        (p for p in (Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()) if p.is_file()), None
    )
    if path is None:
        return None
    try:
        entry = netrc.netrc(path).authenticators(urlsplit(settings.base_url).netloc)
    except (OSError, netrc.NetrcParseError):
        return None
    return f"{path} for {settings.base_url}" if entry else None


def wandb_mode(requested: str) -> tuple[str, str]:
    """``online``, ``offline`` or ``disabled``, and why: ``auto`` follows ``WANDB_MODE``, else whether
    W&B has credentials."""
    if requested not in WANDB_MODES:
        raise ConfigError("logger.wandb.mode", requested, f"is not a W&B mode; use one of {', '.join(WANDB_MODES)}")
    if requested != "auto":
        return requested, f"logger.wandb.mode={requested}"
    env = os.environ.get("WANDB_MODE", "").lower()
    if env in ("online", "offline", "disabled", "dryrun"):
        return ("offline" if env == "dryrun" else env), f"WANDB_MODE={env}"
    found = wandb_credentials()
    if found:
        return "online", f"credentials from {found}"
    return "offline", "not logged in to W&B: no WANDB_API_KEY, no `wandb login`"


class ContinuedMetricsWriter(ExperimentWriter):
    """Lightning's CSV writer, but a run that continues in its folder (resumed, requeued) appends to
    ``metrics.csv`` instead of deleting the rows of its earlier parts."""

    def _check_log_dir_exists(self) -> None:
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as rows:
                self.metrics_keys = next(csv.reader(rows), [])  # new keys make the writer rewrite the header


def drop_metrics_from(path: Path, step: int) -> int:
    """Remove the rows of ``metrics.csv`` that a run resumed at optimizer step ``step`` logs again: those
    of Lightning's step ``step`` and later (a training row of optimizer step N carries step N - 1, a
    validation after step N too; the evaluations after training carry the final step). They were
    written after the checkpoint, by a part of the run that ended before its next one. Returns how many."""
    if not path.is_file():
        return 0
    with open(path, newline="") as file:
        rows = list(csv.reader(file))
    if not rows or "step" not in rows[0]:
        return 0
    column = rows[0].index("step")
    kept = [rows[0], *(row for row in rows[1:] if _row_step(row, column, len(rows[0])) < step)]
    if len(kept) < len(rows):
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(kept)
        atomic_write(path, out.getvalue())
    return len(rows) - len(kept)


def _row_step(row: list[str], column: int, width: int) -> float:
    """A row's step; a row cut short (a process killed while it wrote) counts as after every step."""
    try:
        return int(float(row[column])) if len(row) == width else math.inf
    except ValueError:
        return math.inf


class RunCSVLogger(CSVLogger):
    """``<run_dir>/csv/metrics.csv`` (:data:`METRICS_CSV`) with :class:`ContinuedMetricsWriter`."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ContinuedMetricsWriter:
        if self._experiment is None:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuedMetricsWriter(log_dir=self.log_dir)
        return self._experiment


class WandbRunLogger(WandbLogger):
    """Lightning's W&B logger that picks its mode (:func:`wandb_mode`), falls back to offline when an
    online run cannot start (no network, a rejected key) and to no W&B at all when no run can start,
    and finishes its run explicitly (:meth:`finish`)."""

    def __init__(
        self,
        save_dir: str,
        project: str = "aiayn",
        entity: str | None = None,
        mode: str = "auto",
        name: str | None = None,
        group: str | None = None,
        tags: Sequence[str] = (),
        job_type: str = "train",
        init_timeout: float = 90.0,
    ) -> None:
        import wandb

        # Ranks other than 0 never start a run (Lightning hands them a dummy), nor W&B's service.
        resolved, reason = wandb_mode(mode) if rank_zero_only.rank == 0 else ("disabled", "not rank 0")
        if rank_zero_only.rank == 0:
            log.info("W&B logs %s (%s)", resolved, reason)
        super().__init__(
            name=name,
            save_dir=save_dir,
            project=project,
            entity=entity,
            group=group,
            tags=list(tags),
            job_type=job_type,
            mode=resolved,
            log_model=False,
            settings=wandb.Settings(init_timeout=init_timeout),
        )
        # Lightning passes anonymous=None, which W&B answers with a warning a user cannot act on.
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)

    @property
    def mode(self) -> str:
        return self._wandb_init["mode"]

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        import wandb

        while self._experiment is None and self.mode != "disabled":
            try:
                return super().experiment
            except Exception as error:  # whatever W&B raises, the metrics must not die with the dashboard
                fallback = "offline" if self.mode == "online" else "disabled"
                log.warning("W&B could not start an %s run (%s); logging %s instead", self.mode, error, fallback)
                self._wandb_init["mode"] = fallback
                if wandb.run is not None:
                    wandb.run.finish(exit_code=1)
        return super().experiment

    def finish(self, failed: bool, summary: dict[str, Any] | None = None) -> None:
        """Adds ``summary`` to the run's summary, ends the run (exit code 1 when ``failed``) and says
        where it is, or how to upload it. Only rank 0 ever starts a run; elsewhere this does nothing."""
        run = self._experiment
        if run is None:
            return
        import wandb

        self._experiment = None
        try:
            if summary:
                run.summary.update(summary)
        finally:
            run.finish(exit_code=1 if failed else 0)
            try:
                # finish() can return before W&B's service has flushed the run's files; shutting the
                # service down waits for it, so a job killed right after (a SLURM time limit) loses nothing.
                wandb.teardown()
            except SystemExit as error:  # teardown exits the process when the service failed; the run goes on
                log.warning("W&B's service ended with status %s", error.code)
        if self.mode == "offline":
            log.info("W&B run saved offline; upload it with: wandb sync %s", run.settings.sync_dir)
        elif self.mode == "online":
            log.info("W&B run: %s", run.url)


class TensorBoardRunLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger with one event file per run. Lightning finalizes loggers after fit
    and again after test; closing the writer after fit makes the test's scalars open a second file, and
    when fit took under a second both carry the same name (``events.out.tfevents.<second>.<host>``): the
    second replaces the first. Here Lightning's finalize only flushes; :meth:`close` ends the file."""

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._experiment is not None:
            self._experiment.flush()

    def close(self, status: str) -> None:
        super().finalize(status)


def metrics_flushed_at(trainer: pl.Trainer, step: int) -> bool:
    """Whether Lightning sends the step metrics to the loggers once the optimizer has made ``step``
    steps: at multiples of ``trainer.log_every_n_steps``, never in the middle of an accumulation."""
    n = trainer.log_every_n_steps
    return n > 0 and step % n == 0


def log_run_config(
    loggers: Sequence[Logger],
    config: dict[str, Any],
    overrides: Sequence[str],
    trainer: pl.Trainer,
    model: Any,
    batching: dict[str, Any],
) -> None:
    """Gives every logger ``config`` (the resolved composed config), plus under ``aiayn``: the overrides,
    the code's git commit and dirty flag, the parameter count, the hardware and precision, and the
    effective batch (devices, tokens per device, accumulation)."""
    if not trainer.is_global_zero:  # the other ranks' loggers drop it anyway
        return
    if META_KEY in config:
        raise ValueError(f"the config key {META_KEY!r} is reserved for run metadata; rename it")
    config = dict(config)
    config[META_KEY] = {
        "overrides": list(overrides),
        "git": git_state(Path(__file__).resolve().parent),
        "parameters": count_parameters(model),
        "hardware": describe_hardware(trainer),
        "batch": batching,
    }
    for logger in loggers:
        logger.log_hyperparams(config)


def git_state(path: Path) -> dict[str, Any]:
    """The commit of the git checkout holding ``path`` and whether tracked files differ from it
    (None for both outside a checkout, e.g. an installed wheel)."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


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


def describe_hardware(trainer: pl.Trainer) -> dict[str, Any]:
    """Devices, precision and software versions of a run, as the dashboard shows them."""
    device = trainer.strategy.root_device
    return {
        "accelerator": device.type,
        "device": device_name(device),
        "devices_per_node": trainer.num_devices,
        "num_nodes": trainer.num_nodes,
        "world_size": trainer.world_size,
        "precision": str(trainer.precision),
        "matmul_precision": matmul_precision(str(trainer.precision)),
        "cpu_cores": os.cpu_count(),
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
    }
