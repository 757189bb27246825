"""The optional libraries that the ``[dev]`` extra installs and some tests need (``transformers``,
``ctranslate2``): a missing one fails those tests, as CI must, unless skipping is asked for."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest

# Set to 1 where an install without the [dev] extra is meant: the tests that need it are skipped instead.
ALLOW_SKIP = "AIAYN_TESTS_ALLOW_MISSING_EXTRAS"


def dev_extra(name: str) -> ModuleType:
    """The module ``name``, imported; when it is missing, the test fails, or is skipped where
    ``$AIAYN_TESTS_ALLOW_MISSING_EXTRAS=1``."""
    if os.environ.get(ALLOW_SKIP) == "1":
        return pytest.importorskip(name)
    return importlib.import_module(name)


def toml_reader() -> ModuleType:
    """``tomllib`` (Python 3.11 and later), else the ``tomli`` the [dev] extra installs on 3.10."""
    return importlib.import_module("tomllib") if sys.version_info >= (3, 11) else dev_extra("tomli")
