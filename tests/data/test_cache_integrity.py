"""The data caches are used only when whole: a damaged entry is reported in one warning and rebuilt to what
a clean build gives, concurrent builders do not spoil each other's files, a killed encoder's temporary
token file is removed by the next build, and concurrent first downloads of Multi30k each put a complete
file in place."""

from __future__ import annotations

import gzip
import logging
import multiprocessing
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from aiayn.data import Multi30kDataModule
from aiayn.data import corpus as corpus_module
from aiayn.data.corpus import download_multi30k
from aiayn.data.dataset import EncodedTextWriter


def built(root: Path, cache: Path) -> Multi30kDataModule:
    dm = Multi30kDataModule(root=str(root), cache_dir=str(cache), vocab_size=300, encode_workers=1)
    dm.prepare_data()
    dm.setup()
    return dm


def contents(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def clean_cache(corpus_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of a cache built once, from nothing (``<cache_dir>/tokenized/<entry>``)."""
    return built(corpus_root, tmp_path_factory.mktemp("clean")).cache_folder()


@pytest.fixture(scope="module")
def clean(clean_cache: Path) -> dict[str, bytes]:
    """Every file of the clean cache."""
    return contents(clean_cache)


def copied(clean_cache: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the clean cache (its files' times kept) as ``tmp_path/cache``, and its folder there. A
    build from nothing gives the same bytes: the concurrent builders' test shows it."""
    cache_dir = clean_cache.parents[1]
    shutil.copytree(cache_dir, tmp_path / "cache")
    return tmp_path / "cache", tmp_path / "cache" / clean_cache.relative_to(cache_dir)


def truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flipped(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# (what is damaged, how, the entry the warning names, why)
DAMAGES: list[tuple[str, Callable[[Path], None], str, str]] = [
    ("spm.model", lambda path: path.write_bytes(b""), "spm.model", r"spm\.model has 0 bytes, its manifest says \d+"),
    ("train.en.tokens.npy", truncated, "train.en", r"train\.en\.tokens\.npy has \d+ bytes, its manifest says \d+"),
    ("val.de.tokens.npy", flipped, "val.de", r"val\.de\.tokens\.npy does not match its checksum"),
    ("test.en.offsets.npy", Path.unlink, "test.en", r"test\.en\.offsets\.npy is missing"),
    ("train.de.manifest.json", Path.unlink, "train.de", "no manifest"),
    ("val.en.manifest.json", lambda path: path.write_text('{"files": '), "val.en", r"val\.en\.manifest\.json cannot"),
    ("test.de.manifest.json", lambda path: path.write_text("[]"), "test.de", r"test\.de\.manifest\.json cannot"),
]


@pytest.mark.parametrize(("name", "damage", "entry", "reason"), DAMAGES, ids=[d[0] + "-" + d[2] for d in DAMAGES])
def test_a_damaged_entry_is_reported_once_and_rebuilt_as_a_clean_build(
    corpus_root: Path,
    tmp_path: Path,
    clean_cache: Path,
    clean: dict[str, bytes],
    caplog: pytest.LogCaptureFixture,
    name: str,
    damage: Callable[[Path], None],
    entry: str,
    reason: str,
) -> None:
    cache_dir, folder = copied(clean_cache, tmp_path)
    damage(folder / name)
    with caplog.at_level(logging.WARNING, logger="aiayn.data.cache"):
        dm = built(corpus_root, cache_dir)
    assert dm.cache_folder() == folder
    warnings = [record.getMessage() for record in caplog.records if record.name == "aiayn.data.cache"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"cache entry {folder / entry} is damaged (") and warnings[0].endswith(
        "; rebuilding it"
    )
    assert re.search(reason, warnings[0]), warnings[0]
    assert contents(folder) == clean
    assert len(dm.datasets["train"]) == 500 and len(dm.references["test"]) == 100


def test_a_whole_cache_is_loaded_as_it_is(
    corpus_root: Path, tmp_path: Path, clean_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache_dir, folder = copied(clean_cache, tmp_path)
    stamps = {path.name: path.stat().st_mtime_ns for path in folder.iterdir()}
    entries = ["spm.model", *(f"{split}.{lang}" for split in ("train", "val", "test") for lang in ("en", "de"))]
    assert sorted(path.name for path in folder.glob("*.manifest.json")) == sorted(f"{e}.manifest.json" for e in entries)
    with caplog.at_level(logging.WARNING, logger="aiayn.data.cache"):
        again = built(corpus_root, cache_dir)
    assert not [record for record in caplog.records if record.name == "aiayn.data.cache"]
    assert {path.name: path.stat().st_mtime_ns for path in folder.iterdir()} == stamps  # nothing built again
    assert np.array_equal(again.datasets["train"].src.tokens, np.load(folder / "train.en.tokens.npy"))


def _prepare(root: Path, cache: Path, start: threading.Barrier) -> None:
    start.wait()
    Multi30kDataModule(root=str(root), cache_dir=str(cache), vocab_size=300, encode_workers=1).prepare_data()


def test_two_processes_building_one_cache_at_once_leave_it_whole(
    corpus_root: Path, tmp_path: Path, clean: dict[str, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    context = multiprocessing.get_context("fork")
    start = context.Barrier(2)
    builders = [context.Process(target=_prepare, args=(corpus_root, tmp_path, start)) for _ in range(2)]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join(timeout=300)
    assert [builder.exitcode for builder in builders] == [0, 0]
    with caplog.at_level(logging.WARNING, logger="aiayn.data.cache"):
        folder = built(corpus_root, tmp_path).cache_folder()
    assert not [record for record in caplog.records if record.name == "aiayn.data.cache"]  # whole as it is
    assert contents(folder) == clean  # and no temporary file left


def _encode_and_wait(stem: Path, started: multiprocessing.synchronize.Event) -> None:
    """An encoder stopped mid-split: its tokens so far are in its temporary file, until it is killed."""
    EncodedTextWriter(stem, np.dtype(np.uint16)).append(np.arange(50_000, dtype=np.uint16), np.array([50_000]))
    started.set()
    time.sleep(600)


def test_a_killed_encoders_token_file_is_removed_by_the_next_build_and_a_living_ones_kept(
    corpus_root: Path, tmp_path: Path, clean_cache: Path, clean: dict[str, bytes]
) -> None:
    cache_dir, folder = copied(clean_cache, tmp_path)
    context = multiprocessing.get_context("fork")
    encoders = []
    for _ in range(2):
        started = context.Event()
        encoders.append(context.Process(target=_encode_and_wait, args=(folder / "train.en", started)))
        encoders[-1].start()
        assert started.wait(timeout=60)
    try:
        temporary = {process.pid: [p.name for p in folder.glob(f".train.en.*.{process.pid}.*")] for process in encoders}
        assert all(len(names) == 1 and names[0].endswith(".tmp") for names in temporary.values()), temporary
        killed, living = encoders
        os.kill(killed.pid, signal.SIGKILL)
        killed.join(timeout=60)
        assert (folder / temporary[killed.pid][0]).stat().st_size > 0  # what a kill leaves behind
        (folder / "train.en.manifest.json").unlink()  # the next run encodes the split again
        built(corpus_root, cache_dir)
        assert contents(folder) == {**clean, temporary[living.pid][0]: (folder / temporary[living.pid][0]).read_bytes()}
    finally:
        for process in encoders:
            process.kill()
            process.join(timeout=60)


@contextmanager
def served_in_step(folder: Path) -> Iterator[str]:
    """An HTTP server of ``folder`` that sends a file's body only once two clients are downloading it,
    in two halves: two downloads of one file are sure to overlap. Yields the URL template."""
    barriers = {path.name: threading.Barrier(2, timeout=20) for path in folder.iterdir()}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (folder / self.path.lstrip("/")).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.flush()
            barriers[self.path.lstrip("/")].wait()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            time.sleep(0.1)
            self.wfile.write(body[len(body) // 2 :])

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/{{stem}}.{{lang}}.gz"
    finally:
        server.shutdown()
        server.server_close()


def test_two_first_downloads_at_once_each_put_a_whole_file_in_place(
    corpus_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = tmp_path / "served"
    served.mkdir()
    for plain in corpus_root.glob("*.en"):
        (served / f"{plain.name}.gz").write_bytes(gzip.compress(plain.read_bytes(), mtime=0))
    errors: list[BaseException] = []

    def download() -> None:
        try:
            download_multi30k(tmp_path / "multi30k", ("en",))
        except BaseException as error:  # reported by the test, not lost in the thread
            errors.append(error)

    with served_in_step(served) as url:
        monkeypatch.setattr(corpus_module, "MULTI30K_URL", url)
        downloads = [threading.Thread(target=download) for _ in range(2)]
        for thread in downloads:
            thread.start()
        for thread in downloads:
            thread.join(timeout=120)
    assert errors == []
    assert contents(tmp_path / "multi30k") == contents(served)  # three whole files, nothing else
