"""A stand-in for a Lightning callback (``callbacks=[{_target_: helpers.folder_probe.record, ...}]``) that
records, when a run builds its callbacks, which of ``folders`` a living process holds, then fails the job:
a multirun's jobs end in a moment, and the test sees what each job held while it ran."""

from __future__ import annotations

import json
from pathlib import Path

from aiayn.files import run_folder_holder


def record(folders: list[str], out: str) -> None:
    """Append ``{folder: held}`` to the JSON lines file ``out``, then raise."""
    with open(out, "a") as lines:
        lines.write(json.dumps({folder: run_folder_holder(Path(folder)) is not None for folder in folders}) + "\n")
    raise RuntimeError("folder_probe ends the job here")
