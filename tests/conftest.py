"""Shared fixtures: the corpora (a small generated one in tests/assets for the fast tests, Multi30k beside
the repository for the slow end-to-end ones), one tokenizer cache per session, the session's shared runs
(built once even when pytest-xdist runs the suite in several workers), W&B offline."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]

if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    # A pytest-xdist worker has its share of the cores: torch's threads beyond it (and those of the
    # processes its tests start, which inherit this) only wait on each other's cores. Set before any
    # test module imports torch; runs compared bit for bit share the setting.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // workers)))
# Where a user's shell may send runs and sweeps (aiayn.config.naming): the tests choose their folders.
for name in ("AIAYN_OUTPUT", "AIAYN_SWEEP_DIR", "AIAYN_RUN_DIR", "WANDB_SWEEP_ID", "WANDB_RUN_ID"):
    os.environ.pop(name, None)
# hardware=cpu in fp32 on every CPU, so that the suite's numbers do not depend on the host's bf16 units (the
# tests of bf16 autocast ask for it); the tiny models of the tests gain nothing from bf16 either.
os.environ["AIAYN_CPU_BF16"] = "false"
ASSET_CORPUS = Path(__file__).resolve().parent / "assets" / "corpus"  # written by assets/make_corpus.py


# The slowest test files first: a worker that takes one of them last would end the suite alone while the
# others wait. pytest-xdist hands files out in the order of their first test (with --no-loadscope-reorder;
# by default it hands out the files with the most tests first, however short): the files with slow tests
# (real runs, training for seconds), the slowest folders among them first; then the many short files.
SLOW_FIRST = ("scenarios", "experiments", "export", "cli")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def position(item: pytest.Item) -> tuple[bool, int]:
        folder = item.path.parent.name
        rank = SLOW_FIRST.index(folder) if folder in SLOW_FIRST else len(SLOW_FIRST)
        return item.path not in slow_files, rank

    items.sort(key=position)  # stable: the files and their tests otherwise keep their order


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


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder ``name`` of this test session, made by ``build(folder)`` once: the first pytest-xdist
    worker to ask builds it while the others wait for it (under a lock), then all read it. A build that
    failed left no ``.done``: its folder is cleared before the next one (a run folder holding a
    checkpoint would be continued, not made anew)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's data cache, shared by the workers: the cache is safe for concurrent builders."""
    return built_once(tmp_path_factory, "aiayn-cache", lambda folder: None)


@pytest.fixture(scope="session")
def smoke_run_dir(corpus_root: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``debug=smoke`` run's folder (12 steps; checkpoints after steps 6 and 12, none averaged; its
    test.hyp.txt decoded greedily, at most 3 tokens past the source: an untrained model's translations
    run to the length limit), for the tests that read a real run's files but not train one of their own.
    Read it, never write into it."""
    from helpers.runs import SMOKE_RUN_EXTRA, smoke_run, train_in_process

    def build(folder: Path) -> None:
        argv = [*smoke_run(corpus_root, cache_dir, *SMOKE_RUN_EXTRA), f"hydra.run.dir={folder / 'run'}"]
        with pytest.MonkeyPatch.context() as monkeypatch:
            assert train_in_process(argv, monkeypatch) == 0

    return built_once(tmp_path_factory, "smoke", build) / "run"


@pytest.fixture(scope="session")
def reference_overrides(corpus_root: Path, cache_dir: Path) -> list[str]:
    """The short run (12 steps, a checkpoint every 3) that the tests stop, kill and continue, and that
    must then end as :func:`reference_run` ends."""
    from helpers.runs import resumable_run

    return resumable_run(corpus_root, cache_dir, "trainer.max_steps=12", "checkpoint.every_steps=3")


@pytest.fixture(scope="session")
def reference_run(reference_overrides: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run of :func:`reference_overrides`, a real ``aiayn-train`` process as the runs
    compared with it are, its batches recorded (``batches.rank0.jsonl``). Read it, never write into it."""
    from helpers.batch_recorder import recorder
    from helpers.processes import finish

    def build(folder: Path) -> None:
        finish(f"hydra.run.dir={folder / 'run'}", recorder(folder / "run"), *reference_overrides)

    return built_once(tmp_path_factory, "reference", build) / "run"


@pytest.fixture(scope="session")
def ddp_run(corpus_root: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the short run on 2 DDP ranks of :mod:`helpers.ddp_ranks` (a NaN loss on one rank, the
    EMA on), a real ``aiayn-train`` process, with what each rank held at its end. Read it, never write
    into it."""
    from helpers.ddp_ranks import ddp_run_overrides
    from helpers.processes import finish

    def build(folder: Path) -> None:
        finish(*ddp_run_overrides(corpus_root, cache_dir, folder / "run"))

    return built_once(tmp_path_factory, "ddp", build) / "run"


@pytest.fixture(scope="session")
def smoke_restorer(smoke_run_dir: Path, corpus_root: Path, cache_dir: Path) -> Any:
    """The check (:class:`~aiayn.training.restored_state.RestoredState`) that a resume of the smoke run
    passes its checkpoints through, on a module and trainer built as ``aiayn-train`` builds them."""
    from aiayn.config.compose import compose_run_config
    from aiayn.config.plan import plan_run
    from aiayn.experiments.run import build_trainer, run_callbacks
    from aiayn.training.restored_state import RestoredState
    from helpers.runs import SMOKE_RUN_EXTRA, smoke_run

    plan = plan_run(compose_run_config(smoke_run(corpus_root, cache_dir, *SMOKE_RUN_EXTRA)))
    module = plan.module.build()
    callbacks = run_callbacks(plan, smoke_run_dir)
    module.trainer = build_trainer(plan, smoke_run_dir, callbacks.all(), [], module)
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
