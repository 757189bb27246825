"""Which W&B run a run folder logs to, and how: online when the user is logged in, offline into the run
folder otherwise (a run without an account or a network records everything too; ``wandb sync`` uploads
it later), or not at all.

Every part of a run folder (the first, a resumed or requeued one, a sweep's trial run again) logs to one
W&B run, whose id the folder keeps in ``wandb/run_id`` (:data:`RUN_ID_FILE`). The id is bound to the
folder it was made for, so a copy or a moved folder logs to a new W&B run instead of merging its branch
into the original's. Lightning-free: ``aiayn-report`` picks its W&B mode here too (W&B itself is imported
only where it is used).
"""

from __future__ import annotations

import logging
import netrc
import os
import re
import secrets
import string
from pathlib import Path
from urllib.parse import urlsplit

from aiayn.errors import ConfigError, DataError, FieldError
from aiayn.files import NotPlainFile, atomic_write, open_plain

log = logging.getLogger(__name__)

WANDB_MODES = ("auto", "online", "offline", "disabled")
# In a run folder: the id of the W&B run all its parts log to, bound to the folder (:func:`bind_run_id`).
RUN_ID_FILE = Path("wandb") / "run_id"
# What aiayn takes for a W&B run id: W&B's own ids are 8 of [a-z0-9]; no path or URL characters.
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
RUN_ID_RULE = "1 to 64 letters, digits, '-' or '_'"
RUN_ID_BYTES = 8192  # an id, and a folder's path of at most PATH_MAX (4096) bytes: a larger file is not read


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
        raise FieldError("mode", requested, f"is not a W&B mode; use one of {', '.join(WANDB_MODES)}")
    if requested != "auto":
        return requested, f"mode={requested}"
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
        with open_plain(path) as file:
            content = file.read(RUN_ID_BYTES + 1)
    except FileNotFoundError:
        return None, None
    except NotPlainFile as error:
        return None, error.why
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


def unsynced_parts(wandb_dir: Path, run_id: str) -> list[Path]:
    """The offline parts of W&B run ``run_id`` under ``wandb_dir`` that ``wandb sync`` has not uploaded
    (it marks an uploaded ``run-<id>.wandb`` with ``run-<id>.wandb.synced``)."""
    return sorted(part for part in wandb_dir.glob(f"offline-run-*-{run_id}") if not any(part.glob("*.wandb.synced")))


def in_wandb_sweep() -> bool:
    """Whether this process is a trial of ``wandb agent``, where W&B takes the run id from the agent."""
    return bool(os.environ.get("WANDB_SWEEP_ID"))


def shut_down_wandb() -> None:
    """Ends W&B's service (a later run starts a new one) once it has written what it was given."""
    import wandb

    try:
        wandb.teardown()
    except SystemExit as error:  # teardown exits the process when the service failed; the run goes on
        log.warning("W&B's service ended with status %s", error.code)
