"""Shared fixtures: the corpora (a small generated one in tests/assets for the fast tests, Multi30k beside
the repository for the slow end-to-end ones), one tokenizer cache per session, W&B offline."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSET_CORPUS = Path(__file__).resolve().parent / "assets" / "corpus"  # written by assets/make_corpus.py


@pytest.fixture(scope="session")
def corpus_root() -> Path:
    """A generated parallel corpus in Multi30k's layout, as plain text (500 training, 100 validation and 100 test
    sentences in en, de and fr): for the fast tests, which must run with nothing beside the repository."""
    return ASSET_CORPUS


@pytest.fixture(scope="session")
def multi30k_root() -> Path:
    """Multi30k task 1, for the slow end-to-end tests (``$AIAYN_TEST_DATA`` or ``../shared/data/multi30k``)."""
    root = Path(os.environ.get("AIAYN_TEST_DATA", REPO.parent / "shared" / "data" / "multi30k"))
    assert (root / "train.en.gz").is_file(), f"Multi30k not found at {root}; set AIAYN_TEST_DATA"
    return root


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aiayn-cache")


@pytest.fixture(scope="session")
def smoke_run_dir(corpus_root: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``debug=smoke`` run's folder (12 steps; checkpoints after steps 6 and 12, none averaged; its
    test.hyp.txt decoded greedily, at most 3 tokens past the source: an untrained model's translations
    run to the length limit), for the tests that read a real run's files but not train one of their own.
    Read it, never write into it."""
    from helpers.runs import smoke_run, train_in_process

    run_dir = tmp_path_factory.mktemp("smoke") / "run"
    from helpers.runs import SMOKE_RUN_EXTRA

    argv = [*smoke_run(corpus_root, cache_dir, *SMOKE_RUN_EXTRA), f"hydra.run.dir={run_dir}"]
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert train_in_process(argv, monkeypatch) == 0
    return run_dir


@pytest.fixture(scope="session")
def smoke_restorer(smoke_run_dir: Path, corpus_root: Path, cache_dir: Path) -> Any:
    """The check (:class:`~aiayn.training.restored_state.RestoredState`) that a resume of the smoke run
    passes its checkpoints through, on a module and trainer built as ``aiayn-train`` builds them."""
    from omegaconf import OmegaConf

    from aiayn.config.build import module_kwargs
    from aiayn.config.compose import compose_run_config
    from aiayn.experiments.run import build_trainer, run_callbacks
    from aiayn.training.module import TranslationModule
    from aiayn.training.restored_state import RestoredState
    from helpers.runs import SMOKE_RUN_EXTRA, smoke_run

    cfg = compose_run_config(smoke_run(corpus_root, cache_dir, *SMOKE_RUN_EXTRA))
    module = TranslationModule(**module_kwargs(cfg))
    callbacks = run_callbacks(cfg, smoke_run_dir, OmegaConf.to_container(cfg, resolve=True), [], "quiet")
    module.trainer = build_trainer(cfg.trainer, smoke_run_dir, "quiet", callbacks.all(), [], module)
    return RestoredState(smoke_run_dir / "checkpoints", module)


@pytest.fixture
def wandb_offline(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """W&B as for a user without an account: offline, with its caches in a temporary folder, and
    without what only slows tests down (console capture, system metrics, git and code snapshots)."""
    home = tmp_path_factory.mktemp("wandb-home")
    for name in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(home / "netrc"))  # no credentials
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB__DISABLE_STATS": "true",
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_CONFIG_DIR": str(home / "config"),
    }.items():
        monkeypatch.setenv(name, value)
    yield
    import wandb

    wandb.teardown()  # W&B caches its settings per process; the next test may want others
