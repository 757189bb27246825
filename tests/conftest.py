"""Shared fixtures: the Multi30k corpus beside the repository and one tokenizer cache per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def multi30k_root() -> Path:
    root = Path(os.environ.get("AIAYN_TEST_DATA", REPO.parent / "shared" / "data" / "multi30k"))
    assert (root / "train.en.gz").is_file(), f"Multi30k not found at {root}; set AIAYN_TEST_DATA"
    return root


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aiayn-cache")
