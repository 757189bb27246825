"""What the command-line tools share: reporting a user's mistake in one line, choosing the device."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from aiayn.checkpoints import CheckpointError
from aiayn.data.corpus import DataError

USER_ERRORS = (CheckpointError, DataError, ValueError, FileNotFoundError)


@contextmanager
def reported_as_usage_errors(program: str) -> Iterator[None]:
    """Turn the errors a user can fix (bad paths, bad options, bad data) into ``<program>: error: ...``."""
    try:
        yield
    except USER_ERRORS as error:
        print(f"{program}: error: {error}", file=sys.stderr)
        sys.exit(2)


def resolve_device(device: str) -> torch.device:
    """``auto`` is the first GPU when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
