"""What the command-line tools share: reporting a user's mistake in one line, choosing the device."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from aiayn.checkpoints import CheckpointError
from aiayn.data.corpus import DataError

# OSError: missing, unreadable or misplaced files (a folder where a file belongs, no permission).
USER_ERRORS = (CheckpointError, DataError, ValueError, OSError)


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
        print(f"{program}: error: {error}", file=sys.stderr)
        sys.exit(2)


def resolve_device(device: str) -> torch.device:
    """``auto`` is the first GPU when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device} is not a device; use auto, cpu, cuda or cuda:<index>") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device} but no CUDA GPU is visible here; use device=cpu or device=auto")
    return chosen


def required_checkpoint(checkpoint: str | None) -> Path:
    if not checkpoint:
        raise ValueError("checkpoint=<path to a .ckpt of aiayn-train or aiayn-average> is required")
    return Path(checkpoint)
