"""An exported folder pushed to a Hugging Face Hub repository (``aiayn-export push_to=<user>/<name>``), as
one commit, through ``huggingface_hub``. The token is the library's: ``HF_TOKEN`` in the environment (or
a ``hf auth login``), read when the push is made and written nowhere; ``HF_ENDPOINT`` names another hub."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from aiayn.errors import DataError, FieldError, first_line
from aiayn.extras import require


def _hub() -> Any:
    return require("huggingface_hub", "export", "huggingface_hub (aiayn-export's push_to)")


def endpoint() -> str | None:
    """The hub the push goes to: ``HF_ENDPOINT`` as it is now (the library reads it once, on import)."""
    return os.environ.get("HF_ENDPOINT") or None


def check_push(repo_id: str) -> None:
    """Refuse, before anything is exported, a repository id the Hub would refuse or a push without a token."""
    hub = _hub()
    try:
        hub.utils.validate_repo_id(repo_id)
    except Exception as error:  # the library's HFValidationError, or a TypeError for a number
        allowed = f"must be a Hub repository id, <user or org>/<name> ({first_line(error)})"
        raise FieldError("push_to", repo_id, allowed) from None
    if "/" not in repo_id:
        raise FieldError("push_to", repo_id, "must name its owner too: <user or org>/<name>")
    if not hub.get_token():
        raise FieldError(
            "push_to", repo_id, "needs a Hugging Face token: set HF_TOKEN in the environment (or hf auth login); "
            "it is read for the push and stored nowhere",
        )  # fmt: skip


def push_folder(folder: Path, repo_id: str, message: str) -> str:
    """Upload every file of ``folder`` to the model repository ``repo_id`` (made if missing) as one commit
    with ``message``; returns the commit's URL. A failed upload is a :class:`~aiayn.errors.DataError`
    that says where the folder is kept."""
    hub = _hub()
    api = hub.HfApi(endpoint=endpoint())
    files = sorted(path for path in folder.rglob("*") if path.is_file())
    operations = [
        hub.CommitOperationAdd(path_in_repo=path.relative_to(folder).as_posix(), path_or_fileobj=str(path))
        for path in files
    ]
    try:
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
        commit = api.create_commit(repo_id, operations=operations, commit_message=message, repo_type="model")
    except Exception as error:  # the network's, HTTP's and the Hub's errors come in many types; all end the push
        raise DataError(
            f"push_to={repo_id}: the upload to {endpoint() or 'the Hugging Face Hub'} failed ({first_line(error)}); "
            f"the exported folder is kept in {folder}"
        ) from None
    return str(commit.commit_url)
