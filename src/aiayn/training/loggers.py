"""The run's loggers: CSV always, plus the dashboard the ``logger`` config group picks (W&B by default).

W&B runs online when the user is logged in and offline into the run folder otherwise, so a run without
an account or a network records everything too; ``wandb sync`` uploads it later. Every part of a run
folder (the first, a resumed or requeued one, a sweep's trial run again) logs to one W&B run, whose id
the folder keeps in ``wandb/run_id`` (:data:`RUN_ID_FILE`), at W&B steps that are the trainer's global
steps: the parts' histories continue one another, online and after ``wandb sync`` of offline parts.

A run folder may come from elsewhere (a copy, a colleague's folder, one moved): what the loggers read
back from it is untrusted. The id is bound to the folder it was made for, so a copy or a moved folder
logs to a new W&B run instead of merging its branch into the original's; a file that is not what aiayn
writes there (garbage, a link, a folder) is never followed, and the loggers never write through a link.
"""

from __future__ import annotations

import csv
import io
import logging
import netrc
import os
import re
import secrets
import stat
import string
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.loggers.logger import rank_zero_experiment
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from aiayn.errors import ConfigError, DataError
from aiayn.files import NotPlainFile, atomic_write, open_plain_file
from aiayn.machine import device_name, matmul_precision
from aiayn.model import count_parameters
from aiayn.training.metrics import metric_columns, metric_rows

log = logging.getLogger(__name__)

WANDB_MODES = ("auto", "online", "offline", "disabled")
META_KEY = "aiayn"  # the dashboard config's entry for what the composed config does not hold
# In a run folder: the id of the W&B run all its parts log to, bound to the folder (:func:`bind_run_id`).
RUN_ID_FILE = Path("wandb") / "run_id"
# What aiayn takes for a W&B run id: W&B's own ids are 8 of [a-z0-9]; no path or URL characters.
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
RUN_ID_RULE = "1 to 64 letters, digits, '-' or '_'"
RUN_ID_BYTES = 8192  # an id, and a folder's path of at most PATH_MAX (4096) bytes: a larger file is not read
WANDB_FOLDERS = ("wandb", ".wandb")  # where W&B writes in its save_dir (.wandb instead of wandb when it exists)


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


def bound_run_id(run_dir: Path) -> tuple[str | None, str | None]:
    """The W&B run id that ``run_dir``'s :data:`RUN_ID_FILE` binds to ``run_dir`` (its first line; the
    second is the folder's resolved path, :func:`bind_run_id`), else None and why not (None when there is
    no file). The file is untrusted (a copied or shared folder, an edit by hand): it is read only when it
    is a plain file, never whole when large, and an id is taken only when it is one of :data:`RUN_ID`
    (W&B puts it into paths and URLs) and bound to this very folder. A copy of the folder, or the folder
    moved, holds the path of its original: it is another branch of the run, for a W&B run of its own."""
    path = run_dir / RUN_ID_FILE
    try:
        with open_plain_file(path) as file:
            content = file.read(RUN_ID_BYTES + 1)
    except FileNotFoundError:
        return None, None
    except NotPlainFile as why:
        return None, str(why)
    if len(content) > RUN_ID_BYTES:
        return None, f"holds more than a run id and its folder ({RUN_ID_BYTES} bytes)"
    first, _, rest = content.partition(b"\n")
    run_id = first.decode("ascii", errors="replace").strip()
    if not RUN_ID.fullmatch(run_id):
        return None, f"{_shown(first)} is not a W&B run id ({RUN_ID_RULE})"
    folder = rest.removesuffix(b"\n").removesuffix(b"\r")
    if not folder:
        return None, f"W&B run {run_id} is bound to no folder (written by hand, or by an older aiayn)"
    if folder != os.fsencode(run_dir.resolve()):
        return None, f"W&B run {run_id} is the run of {_shown(folder)}: this folder is a copy of it, or moved"
    return run_id, None


def bind_run_id(run_dir: Path, run_id: str) -> None:
    """Write ``run_id`` to ``run_dir``'s :data:`RUN_ID_FILE`, bound to the folder: the id, then the
    folder's resolved path, one line each. A link there is replaced, never followed."""
    path = run_dir / RUN_ID_FILE
    try:
        if path.is_symlink():  # atomic_write would take its target's permissions; the rename replaces it
            path.unlink()
        atomic_write(path, run_id.encode("ascii") + b"\n" + os.fsencode(run_dir.resolve()) + b"\n")
    except (IsADirectoryError, NotADirectoryError, PermissionError) as error:
        raise DataError(
            f"{path}: cannot write the folder's W&B run id there ({error.strerror}); remove what is in its "
            "place, or make the folder writable"
        ) from None


def folder_run_id(run_dir: Path) -> str:
    """The W&B run id of the run in ``run_dir``: the one the folder keeps (:func:`bound_run_id`); for a
    new folder, the trial's under ``wandb agent`` (which sets ``WANDB_SWEEP_ID`` and ``WANDB_RUN_ID``; W&B
    ignores any other id in a sweep, and the trial's folder is named after it), else a new one. A
    :data:`RUN_ID_FILE` that binds no id to the folder (a copy, garbage) counts as none, with one warning.
    Any other ``WANDB_RUN_ID`` in the environment (a surrounding W&B run's, a shell's export) is not
    taken: every new folder, each job of a multirun, would continue one W&B run."""
    stored, unusable = bound_run_id(run_dir)
    if stored is not None:
        return stored
    agents = os.environ.get("WANDB_RUN_ID", "") if in_wandb_sweep() else ""
    if agents and not RUN_ID.fullmatch(agents):
        raise ConfigError("WANDB_RUN_ID", agents, f"is not a W&B run id ({RUN_ID_RULE})")
    # As W&B makes its own: 8 random base-36 digits, drawn apart from the seeded generators.
    run_id = agents or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    if unusable:
        log.warning("%s: %s; this folder logs to a new W&B run, %s", run_dir / RUN_ID_FILE, unusable, run_id)
    return run_id


def _shown(content: bytes) -> str:
    """Bytes of an untrusted file as one short line of a message."""
    text = os.fsdecode(content)
    return repr(text[:200]) + ("..." if len(text) > 200 else "")


def refuse_links(root: Path, folder: Path, files: Sequence[str] = ()) -> None:
    """A :class:`DataError` when a folder on the way from the run folder ``root`` to its ``folder`` is a
    link or not a folder, or one of ``files`` in it a link or not a plain file: a logger writes there, and
    a link in a copied or shared run folder would make it write outside the run folder. A ``folder`` that
    is not in ``root`` is one the user named: theirs, not checked."""
    try:
        parts = Path(folder).relative_to(root).parts
    except ValueError:
        return
    folders = [(root.joinpath(*parts[:n]), stat.S_ISDIR) for n in range(1, len(parts) + 1)]
    for path, kind in folders + [(Path(folder) / name, stat.S_ISREG) for name in files]:
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            if kind is stat.S_ISDIR:
                return  # nothing in it either: what the logger writes there is new
            continue
        except OSError as error:
            raise DataError(f"{path}: cannot be read ({error.strerror}); the run writes there") from None
        if not kind(mode):
            what = "a link" if stat.S_ISLNK(mode) else "not a folder" if kind is stat.S_ISDIR else "not a plain file"
            raise DataError(f"{path}: is {what}; a run writes its logs only into its own folder: move it out of {root}")


def unsynced_parts(wandb_dir: Path, run_id: str) -> list[Path]:
    """The offline parts of W&B run ``run_id`` under ``wandb_dir`` that ``wandb sync`` has not uploaded
    (it marks an uploaded ``run-<id>.wandb`` with ``run-<id>.wandb.synced``)."""
    return sorted(part for part in wandb_dir.glob(f"offline-run-*-{run_id}") if not any(part.glob("*.wandb.synced")))


def in_wandb_sweep() -> bool:
    """Whether this process is a trial of ``wandb agent``, where W&B takes the run id from the agent."""
    return bool(os.environ.get("WANDB_SWEEP_ID"))


class ContinuedMetricsWriter(ExperimentWriter):
    """Lightning's CSV writer, but a run that continues in its folder (resumed, requeued) appends to
    ``metrics.csv`` instead of deleting the rows of its earlier parts, and rewrites it (for new columns)
    atomically, from its readable rows (:func:`metric_rows`): a kill while it rewrites loses nothing."""

    def _check_log_dir_exists(self) -> None:
        self.metrics_keys = metric_columns(Path(self.metrics_file_path))  # new keys rewrite the header

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        path = Path(self.metrics_file_path)

        def write(out: IO[bytes]) -> None:
            text = io.TextIOWrapper(out, encoding="utf-8", newline="")
            rows = csv.DictWriter(text, fieldnames=fieldnames)
            rows.writeheader()
            rows.writerows(metric_rows(path))
            text.flush()
            text.detach()  # atomic_write closes the file itself

        atomic_write(path, write)


class RunCSVLogger(CSVLogger):
    """``<run_dir>/csv/metrics.csv`` (:data:`METRICS_CSV`) with :class:`ContinuedMetricsWriter`. A run
    folder whose ``csv`` folder or files are links (or not folder and files) is refused
    (:func:`refuse_links`): Lightning's writers would follow them."""

    def __init__(self, save_dir: str, name: str = "csv", version: str = "") -> None:
        super().__init__(save_dir, name=name, version=version)
        files = (ContinuedMetricsWriter.NAME_METRICS_FILE, ExperimentWriter.NAME_HPARAMS_FILE)
        refuse_links(Path(save_dir), Path(self.log_dir), files)

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
    and finishes its run explicitly (:meth:`finish`).

    All parts of the run in ``save_dir`` log to one W&B run: its id (:func:`folder_run_id`) is written
    to ``save_dir``'s :data:`RUN_ID_FILE`, bound to the folder, before the first part starts it, and every
    part passes it with ``resume="allow"`` (an offline part records that it resumes, so ``wandb sync``
    appends it); a copy of the folder starts a W&B run of its own. A ``wandb`` (or ``.wandb``) that is a
    link or not a folder is refused: W&B would write through it, outside the run folder. Metrics
    are logged at W&B step = the trainer's global step (:meth:`log_metrics`), so that the parts' steps
    continue one another instead of each starting at 0."""

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

        # Ranks other than 0 never start a run (Lightning hands them a dummy), nor W&B's service, nor
        # read or write the run id.
        resolved, reason = wandb_mode(mode) if rank_zero_only.rank == 0 else ("disabled", "not rank 0")
        self.run_dir = Path(save_dir)
        if resolved != "disabled":
            for folder in WANDB_FOLDERS:
                refuse_links(self.run_dir, self.run_dir / folder)
        self.run_id = folder_run_id(self.run_dir) if resolved != "disabled" else None
        self.run_id_file = self.run_dir / RUN_ID_FILE
        if rank_zero_only.rank == 0:
            log.info("W&B logs %s (%s)%s", resolved, reason, f" to run {self.run_id}" if self.run_id else "")
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
            # Lightning adds resume="allow". In a sweep W&B uses the agent's id, and warns about any other.
            id=None if in_wandb_sweep() else self.run_id,
        )
        # Lightning passes anonymous=None, which W&B answers with a warning a user cannot act on.
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
        self._said_replayed = False  # whether log_metrics said that it skips steps the W&B run holds

    @property
    def mode(self) -> str:
        return self._wandb_init["mode"]

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None and self.mode != "disabled":
            self._start()
        return super().experiment

    def _start(self) -> None:
        """Starts the W&B run, as offline when it cannot start online, with no W&B when it cannot start
        at all. The folder's run id is written before: a part killed while W&B starts keeps it."""
        import wandb

        if bound_run_id(self.run_dir)[0] != self.run_id:
            bind_run_id(self.run_dir, self.run_id)
        if self.mode == "online" and (waiting := unsynced_parts(self.run_id_file.parent, self.run_id)):
            log.warning(
                "%d offline parts of W&B run %s are not uploaded yet: upload them before this part logs online "
                "(wandb sync %s), or W&B puts them after it", len(waiting), self.run_id, self.run_id_file.parent,
            )  # fmt: skip
        while self._experiment is None and self.mode != "disabled":
            try:
                run = super().experiment
            except Exception as error:  # whatever W&B raises, the metrics must not die with the dashboard
                fallback = "offline" if self.mode == "online" else "disabled"
                why = " ".join(str(error).split())  # one line: W&B's messages can have several
                log.warning("W&B could not start an %s run (%s); logging %s instead", self.mode, why, fallback)
                self._wandb_init["mode"] = fallback  # with the same id: offline parts sync into the run
                if wandb.run is not None:
                    wandb.run.finish(exit_code=1)
                shut_down_wandb()  # its service keeps the failed run's id in use; a new one lets the fallback take it
                continue
            if run.id != self.run_id:
                log.warning(
                    "W&B logs this part to run %s (a sweep agent's), not to %s of %s", run.id, self.run_id,
                    self.run_id_file,
                )  # fmt: skip

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Logs ``metrics`` at W&B step ``step``, the trainer's global step (also ``trainer/global_step``,
        the charts' x-axis), not at W&B's own count of ``log`` calls, which starts at 0 in every part:
        two offline parts of one run would repeat their steps. The metrics of one step (training,
        validation, its media; the evaluations after training at the final step) make one history row,
        which holds one value per key: the test of the averaged checkpoint replaces the best one's there
        (the summary has both, from ``results.json``).

        An online part that continues a W&B run already holding steps from ``step`` on (an earlier
        part logged past its last checkpoint, or evaluated before it was killed) does not log them
        again: W&B keeps the first values (``metrics.csv`` has the new ones) and would refuse each with
        a warning."""
        if step is None:
            super().log_metrics(metrics)
            return
        run = self.experiment
        if step < run.starting_step:
            if not self._said_replayed:
                log.info("W&B run %s holds steps before %d already; it gets this part's from there", run.id,
                         run.starting_step)  # fmt: skip
                self._said_replayed = True
            return
        run.log({**metrics, "trainer/global_step": step}, step=step)

    def finish(self, failed: bool, summary: dict[str, Any] | None = None) -> None:
        """Adds ``summary`` to the run's summary, ends the run (exit code 1 when ``failed``) and says
        where it is, or how to upload it. Only rank 0 ever starts a run; elsewhere this does nothing."""
        run = self._experiment
        if run is None:
            return
        self._experiment = None
        try:
            if summary:
                run.summary.update(summary)
        finally:
            run.finish(exit_code=1 if failed else 0)
            # finish() can return before W&B's service has flushed the run's files; shutting the service
            # down waits for it, so a job killed right after (a SLURM time limit) loses nothing.
            shut_down_wandb()
        if self.mode == "offline":
            parts = Path(run.settings.sync_dir).parent
            if len(list(parts.glob(f"offline-run-*-{run.id}"))) > 1:  # one wandb sync uploads them in order
                log.info("W&B run saved offline; upload it with its earlier parts: wandb sync %s", parts)
            else:
                log.info("W&B run saved offline; upload it with: wandb sync %s", run.settings.sync_dir)
        elif self.mode == "online":
            log.info("W&B run: %s", run.url)


def shut_down_wandb() -> None:
    """Ends W&B's service (a later run starts a new one) once it has written what it was given."""
    import wandb

    try:
        wandb.teardown()
    except SystemExit as error:  # teardown exits the process when the service failed; the run goes on
        log.warning("W&B's service ended with status %s", error.code)


class TensorBoardRunLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger with one event file per run. Lightning finalizes loggers after fit
    and again after test; closing the writer after fit makes the test's scalars open a second file, and
    when fit took under a second both carry the same name (``events.out.tfevents.<second>.<host>``): the
    second replaces the first. Here Lightning's finalize only flushes; :meth:`close` ends the file. A log
    folder or ``hparams.yaml`` that is a link is refused (:func:`refuse_links`)."""

    def __init__(self, save_dir: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(save_dir, *args, **kwargs)
        refuse_links(Path(save_dir), Path(self.log_dir), ("hparams.yaml",))

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
