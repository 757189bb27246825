"""What the command-line tools share: reporting a user's mistake in one line."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hydra.errors import CompactHydraException
from omegaconf.errors import OmegaConfBaseException

from aiayn.config.settings import unread_override
from aiayn.errors import CheckpointError, ConfigError, DataError, RunFolderBusy, TrainingDiverged, first_line
from aiayn.extras import missing_hydra_plugin
from aiayn.files import LOCK_FILE
from aiayn.machine import process_rank

# OSError: missing, unreadable or misplaced files (a folder where a file belongs, no permission).
USER_ERRORS = (CheckpointError, DataError, ValueError, OSError)
# What a training run reports in one line: a bad setting, bad data or a bad checkpoint (exit 2). Other
# errors keep their traceback: a ValueError deep in a long run is more likely a bug than a typo.
RUN_INPUT_ERRORS = (ConfigError, DataError, CheckpointError, RunFolderBusy)
IO_ERROR_STATUS = 74  # EX_IOERR of sysexits.h: the disk is full, a file system failed or went away
STORAGE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ESTALE}  # ... reported with it
_REPORTING = "AIAYN_REPORTS_HYDRA_ERRORS"  # set with HYDRA_FULL_ERROR by us, not by the user


@contextmanager
def reported_as_usage_errors(program: str) -> Iterator[None]:
    """Turn the errors a user can fix (bad paths, bad options, bad data) into ``<program>: error: ...``."""
    try:
        yield
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except USER_ERRORS as error:
        fail(program, error, 2)


@contextmanager
def reported_hydra_errors(program: str) -> Iterator[None]:
    """Around a Hydra app: Hydra's own errors (an unknown key or config option, a malformed override) and
    interpolations that cannot be resolved, in one line on stderr, exit status 2.

    A config option that only a plugin this install lacks provides (``hardware=slurm``'s launcher) is said
    with the ``pip install`` that brings it (:func:`aiayn.extras.missing_hydra_plugin`).

    Hydra prints them itself, with a hint about tracebacks, and exits with 1, unless ``HYDRA_FULL_ERROR=1``,
    when it raises them: that is set here, for this process and the DDP ranks it starts. A user who
    sets ``HYDRA_FULL_ERROR=1`` gets Hydra's tracebacks instead.
    """
    if os.environ.get("HYDRA_FULL_ERROR") == "1" and _REPORTING not in os.environ:
        yield
        return
    saved = {name: os.environ.get(name) for name in ("HYDRA_FULL_ERROR", _REPORTING)}
    os.environ.update({"HYDRA_FULL_ERROR": "1", _REPORTING: "1"})
    try:
        yield
    except CompactHydraException as error:  # a plugin's option without the plugin: the extra that brings it
        fail(program, missing_hydra_plugin(error) or unread_override(error, program.removeprefix("aiayn-")) or error, 2)
    except OmegaConfBaseException as error:  # an interpolation that cannot be resolved: name='${oops}'
        fail(program, unresolvable(error), 2)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def reported_run_errors(program: str, run_dir: Path, created: bool, again: str = "") -> Iterator[None]:
    """Around a training run (inside the Hydra app): one line on stderr, no traceback, for

    - :data:`RUN_INPUT_ERRORS`: exit status 2, fix the input and run again; ``run_dir`` is removed when
      this command ``created`` it and it holds nothing but Hydra's files and the lock (the run never
      started; never when another process holds the folder);
    - :class:`~aiayn.errors.TrainingDiverged`: status 1;
    - :class:`~aiayn.training.callbacks.preemption.Preempted` (a checkpoint was saved at a signal):
      128 + the signal's number, as a shell reports a process that a signal ended, with the command
      that continues the run (:func:`continue_advice`); Lightning's stop at SIGTERM after training
      (while testing) likewise;
    - an ``OSError`` of the storage (:data:`STORAGE_ERRORS`: a full disk or quota, a failing, read-only
      or vanished file system): :data:`IO_ERROR_STATUS`; the checkpoints already written are whole
      (they are written atomically);
    - Ctrl-C outside training (while data is prepared, while the best checkpoint is evaluated):
      130, with the way to continue.
    """
    # Here, not at the top: the commands that do not train share this module and start without Lightning.
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    from aiayn.training.callbacks.preemption import Preempted

    try:
        yield
    except (*RUN_INPUT_ERRORS, OmegaConfBaseException) as error:
        if created and process_rank() == 0 and not isinstance(error, RunFolderBusy):
            remove_unstarted_run(run_dir)
        fail(program, unresolvable(error) if isinstance(error, OmegaConfBaseException) else error, 2)
    except TrainingDiverged as error:
        fail(program, error, 1)
    except Preempted as error:
        fail(program, f"{error} {continue_advice(run_dir, created, again)}", 128 + error.signum, "stopped")
    except SIGTERMException:
        message = f"SIGTERM received after training; {continue_advice(run_dir, created, again)} to evaluate it"
        fail(program, message, 128 + signal.SIGTERM, "stopped")
    except KeyboardInterrupt:  # Ctrl-C outside training (preparing data, evaluating): nothing new was saved
        message = f"SIGINT received outside training; {continue_advice(run_dir, created, again)}"
        fail(program, message, 128 + signal.SIGINT, "stopped")
    except OSError as error:
        if error.errno not in STORAGE_ERRORS:
            raise
        fail(program, f"{error} (an input/output error: free space or fix the file system, then run "
             f"again; {continue_advice(run_dir, created, again)})", IO_ERROR_STATUS, "I/O error")  # fmt: skip


def unresolvable(error: OmegaConfBaseException) -> str:
    """One line for a setting OmegaConf cannot resolve (``name='${oops}'``), naming its key."""
    where = f" (in {error.full_key})" if getattr(error, "full_key", None) else ""
    return f"a setting cannot be resolved: {first_line(error)}{where}; check the ${{...}} of the overrides"


def remove_unstarted_run(run_dir: Path) -> None:
    """Remove the folder ``run_dir`` that this command reserved (:func:`aiayn.config.naming.run_dir`) when it
    holds nothing a run trained (:func:`nothing_trained`), and then its parent (``outputs/<name>``) when
    that is empty: a run refused before its first step leaves no folder."""
    if run_dir.is_symlink() or not nothing_trained(run_dir):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    with contextlib.suppress(OSError):
        run_dir.parent.rmdir()  # only when empty


def nothing_trained(run_dir: Path) -> bool:
    """``run_dir`` holds nothing of training: Hydra's files, its log, the lock, and what a run writes
    before its first step (its ``config.yaml``; the CSV logger's ``hparams.yaml``), as when a setting is
    refused once the corpus is read (a validation interval longer than an epoch), or the corpus itself."""

    def written_before_training(path: Path) -> bool:
        if path.is_symlink():
            return False
        if path.name == "csv" and path.is_dir():
            return all(entry.name == "hparams.yaml" and not entry.is_symlink() for entry in path.iterdir())
        return path.name in (".hydra", LOCK_FILE, "config.yaml") or path.suffix == ".log"

    return run_dir.is_dir() and all(written_before_training(path) for path in run_dir.iterdir())


def continue_advice(run_dir: Path, created: bool, again: str = "") -> str:
    """How to continue the run of ``run_dir``: the same command plus ``again`` (``hydra.sweep.dir=...``
    for a multirun's job); the same command where it names the folder (a sweep's trial,
    ``hydra.run.dir=``); else with the folder added, since the same command starts a new one."""
    if again:
        return f"continue it with the same command plus {again}"
    if created:
        return f"continue it with the same command plus hydra.run.dir={run_dir}"
    return "continue it with the same command"


class _LibraryTips(logging.Filter):
    """Drops Lightning's advertisement of its cloud logger, printed at every Trainer's start."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_libraries() -> None:
    """Keep the console to lines a user can act on: no advertisements, no deprecation warnings that
    Lightning raises about torch's own internals (they are for Lightning's developers), no warning that
    a continued run's checkpoint folder is not empty."""
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_LibraryTips())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # A continued run writes into its own checkpoints/ folder by design (LastCheckpoint owns last.ckpt).
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


def fail(program: str, error: BaseException | str, status: int, what: str = "error") -> None:
    """``<program>: <what>: <the error's message in one line>`` on stderr (once, by DDP rank 0), and exit
    with ``status``."""
    if process_rank() == 0:
        message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
        print(f"{program}: {what}: {message}", file=sys.stderr)
    sys.exit(status)
