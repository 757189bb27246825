"""Every file aiayn reads from a folder a user hands it (a corpus, an exported model, a sweep's folder, a
data cache) is a plain file, read up to a stated limit: a FIFO, a device, a link to one, a file too
large, a runaway line or a record of any shape ends in one line naming the file, at once and in bounded
memory. Each read runs in a thread of its own, so that a read that blocks or never ends fails its test
instead of hanging the suite."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import threading
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aiayn.cli import translate as translate_cli
from aiayn.config.naming import sweep_parameters
from aiayn.data.cache import CacheEntry
from aiayn.data.corpus import file_digest, read_lines
from aiayn.errors import DataError
from aiayn.evaluation.settings import is_checkpoint_file
from aiayn.experiments.sweeps.file import load_sweep
from aiayn.experiments.sweeps.launchers import read_exit_file
from aiayn.experiments.sweeps.state import STATE_FILE, SweepError, SweepState
from aiayn.export.folder import PROVENANCE_BYTES, PROVENANCE_FILE, check_plain_files, read_provenance
from aiayn.files import LINE_BYTES, bounded_lines, read_plain_file
from helpers.runs import exit_status

SECONDS = 10  # a refusal takes milliseconds; a read of a FIFO would wait forever, one of /dev/zero never end


def outcome(call: Callable[[], Any]) -> Any:
    """What ``call`` returned or raised, run in a daemon thread: after :data:`SECONDS` the test fails."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(call())
        except Exception as error:
            result.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(SECONDS)
    assert result, f"still reading after {SECONDS} s: a FIFO or a device was opened as a file"
    return result[0]


def refusal(call: Callable[[], Any], kind: type[Exception], path: Path) -> str:
    """The one-line message of the ``kind`` that ``call`` raises, which names ``path``."""
    error = outcome(call)
    assert isinstance(error, kind), repr(error)
    message = str(error)
    assert "\n" not in message and str(path) in message and len(message) < 600, message
    return message


@pytest.fixture
def hostile(tmp_path: Path) -> Iterator[Callable[[Path, str], Path]]:
    """``hostile(path, kind)`` puts a FIFO (``fifo``) or a link to ``/dev/zero`` (``zero``) at ``path``. A
    reader left waiting on a FIFO is let go at the end (its write end opened and closed)."""
    fifos: list[Path] = []

    def make(path: Path, kind: str) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "fifo":
            os.mkfifo(path)
            fifos.append(path)
        else:
            path.symlink_to("/dev/zero")
        return path

    yield make
    for fifo in fifos:
        with contextlib.suppress(OSError):  # ENXIO: no reader waits on it
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


KINDS = ("fifo", "zero")


def nested(levels: int) -> str:
    """JSON text of lists ``levels`` deep (built as text: Python's encoder would recurse)."""
    return "[" * levels + "1" + "]" * levels


# -- the helper every such read goes through ------------------------------------------------------------


@pytest.mark.parametrize("follow_links", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_a_fifo_or_a_device_is_refused_whether_links_are_followed_or_not(
    kind: str, follow_links: bool, tmp_path: Path, hostile: Callable[[Path, str], Path]
) -> None:
    path = hostile(tmp_path / "record.json", kind)
    message = refusal(lambda: read_plain_file(path, 1 << 20, follow_links=follow_links), DataError, path)
    what = "is a link" if kind == "zero" and not follow_links else "is a FIFO" if kind == "fifo" else "is a device"
    assert message == f"{path}: {what}, not a plain file"


def test_a_plain_file_is_read_up_to_its_limit_and_a_link_to_one_only_when_asked(tmp_path: Path) -> None:
    plain, link = tmp_path / "plain", tmp_path / "link"
    plain.write_bytes(b"x" * 100)
    link.symlink_to(plain)
    assert read_plain_file(plain, 100) == b"x" * 100 == read_plain_file(link, 100, follow_links=True)
    too_large = refusal(lambda: read_plain_file(plain, 99), DataError, plain)
    assert too_large == f"{plain}: more than the 99 bytes such a file has"
    refusal(lambda: read_plain_file(link, 100), DataError, link)
    refusal(lambda: read_plain_file(tmp_path, 100), DataError, tmp_path)  # a folder
    assert isinstance(outcome(lambda: read_plain_file(tmp_path / "missing", 100)), FileNotFoundError)


def test_a_file_without_a_size_is_read_up_to_the_limit_only() -> None:
    """/proc's files say they have 0 bytes: they are read on, and still no further than the limit."""
    status = Path("/proc/self/status")
    assert read_plain_file(status, 1 << 20).startswith(b"Name:")
    refusal(lambda: read_plain_file(status, 10), DataError, status)


class _Counting:
    """A binary stream that counts how far it was read."""

    def __init__(self, data: bytes) -> None:
        self.data, self.position = data, 0

    def readline(self, size: int) -> bytes:
        end = self.data.find(b"\n", self.position, self.position + size)
        stop = min(len(self.data), self.position + size) if end < 0 else end + 1
        line, self.position = self.data[self.position : stop], stop
        return line


def test_lines_at_the_limit_are_read_and_a_longer_one_is_named_having_read_the_limit() -> None:
    stream = _Counting(b"1234\n12345\n123\r\n")
    assert list(bounded_lines(stream, "text", limit=5)) == [b"1234", b"12345", b"123\r"]
    stream = _Counting(b"ok\n" + b"x" * 1000 + b"\nmore\n")
    with pytest.raises(DataError, match=r"^text:2: a line of more than 5 bytes; a line holds one sentence$"):
        list(bounded_lines(stream, "text", limit=5))
    assert stream.position <= 3 + 6  # the good line, then the limit and one byte more
    assert list(bounded_lines(_Counting(b"last without a feed"), "text", limit=19)) == [b"last without a feed"]


# -- corpora and texts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["train.en", "train.en.gz"])
def test_a_corpus_file_that_is_a_fifo_or_a_device_is_refused_in_one_line(
    kind: str, name: str, tmp_path: Path, hostile: Callable[[Path, str], Path]
) -> None:
    path = hostile(tmp_path / name, kind)
    refusal(lambda: read_lines(path), DataError, path)
    refusal(lambda: file_digest([path]), DataError, path)  # the fingerprint that names the cache


def test_a_corpus_file_may_be_a_link_to_a_plain_file(tmp_path: Path) -> None:
    (tmp_path / "real.de").write_bytes(b"ein haus\r\nzwei\n")
    (tmp_path / "train.de").symlink_to(tmp_path / "real.de")
    assert read_lines(tmp_path / "train.de") == ["ein haus", "zwei"]


def test_a_runaway_line_in_a_small_gz_is_refused_with_file_and_line_in_bounded_memory(tmp_path: Path) -> None:
    """64 MiB of one line, 64 kB compressed: refused after LINE_BYTES (1 MiB) of it, the memory the read
    takes (tracemalloc's peak) under 8 MiB; without the limit the line alone would be 64 MiB."""
    path = tmp_path / "train.en.gz"
    with path.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb") as packed:
        packed.write(b"a good line\nanother\n")
        for _ in range(64):
            packed.write(b"a" * (1 << 20))
    assert path.stat().st_size < 200_000
    tracemalloc.start()
    try:
        error = outcome(lambda: read_lines(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(error, DataError) and str(error) == (
        f"{path}:3: a line of more than {LINE_BYTES} bytes; a line holds one sentence"
    )
    assert peak < 8 << 20, peak


def test_a_gz_corpus_keeps_its_checks_line_by_line(tmp_path: Path) -> None:
    path = tmp_path / "val.de.gz"
    path.write_bytes(gzip.compress(b"eins\r\nzwei\n\xff drei\n"))
    with pytest.raises(DataError, match=r"val\.de\.gz:3: invalid UTF-8"):
        read_lines(path)
    path.write_bytes(gzip.compress(b"eins\r\nzwei\n"))
    assert read_lines(path) == ["eins", "zwei"]
    path.write_bytes(zlib.compress(b"eins\n"))  # no gzip header
    with pytest.raises(DataError, match=r"val\.de\.gz: cannot be read \(Not a gzipped file"):
        read_lines(path)


def test_a_text_to_translate_has_its_lines_bounded_too() -> None:
    lines = translate_cli.Utf8Lines(io.BytesIO(b"one\r\n" + b"x" * (2 * LINE_BYTES) + b"\n"), "source.txt")
    with pytest.raises(DataError, match=rf"^source\.txt:2: a line of more than {LINE_BYTES} bytes"):
        list(lines)


@pytest.mark.parametrize("kind", KINDS)
def test_aiayn_translate_refuses_an_input_that_is_a_fifo_or_a_device_before_loading_a_model(
    kind: str,
    tmp_path: Path,
    hostile: Callable[[Path, str], Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = hostile(tmp_path / "source.txt", kind)
    monkeypatch.chdir(tmp_path)
    argv = ["aiayn-translate", "checkpoint=no-such.ckpt", f"input={source}"]
    assert outcome(lambda: exit_status(translate_cli.main, argv, monkeypatch)) == 2
    what = "a FIFO" if kind == "fifo" else "a device"
    assert capsys.readouterr().err == f"aiayn-translate: error: {source}: is {what}, not a plain file\n"


@pytest.mark.parametrize("kind", KINDS)
def test_a_compared_system_is_sniffed_only_as_a_plain_file(
    kind: str, tmp_path: Path, hostile: Callable[[Path, str], Path]
) -> None:
    path = hostile(tmp_path / "system.ckpt", kind)
    refusal(lambda: is_checkpoint_file(path), DataError, path)


# -- an exported model's folder -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_an_exported_folders_provenance_that_is_a_fifo_or_a_device_is_refused(
    kind: str, tmp_path: Path, hostile: Callable[[Path, str], Path]
) -> None:
    path = hostile(tmp_path / "model" / PROVENANCE_FILE, kind)
    message = refusal(lambda: read_provenance(path.parent), ValueError, path)
    assert message.endswith("export the model again")
    assert refusal(lambda: check_plain_files(path.parent), ValueError, path).startswith(f"{path}: is ")


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"[" * 100_000, "is not JSON"),  # deeper than Python's parser recurses
        (b"\xff\xfe{}", "is not JSON"),
        (b" " * (PROVENANCE_BYTES + 1), f"more than the {PROVENANCE_BYTES} bytes"),
        (b'{"model": "x"}', "has no model section"),
        (b'{"model": {}, "run_config": ' + nested(500).encode() + b"}", "nested deeper than 32 levels"),
    ],
)
def test_an_exported_folders_malformed_provenance_is_refused_in_one_line(
    content: bytes, says: str, tmp_path: Path
) -> None:
    path = tmp_path / PROVENANCE_FILE
    path.write_bytes(content)
    assert says in refusal(lambda: read_provenance(tmp_path), ValueError, path)


# -- a sweep's folder -----------------------------------------------------------------------------------

CONFIG = {"method": "grid", "parameters": {"seed": {"values": [1, 2]}}}
TRIAL = {"number": 1, "params": {"seed": 1}, "state": "finished", "run_dir": "trial-0001"}


def opened(folder: Path) -> Any:
    return outcome(lambda: SweepState.open(folder, CONFIG, folder / "sweep.yaml"))


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"[" * 100_000, "unreadable sweep state (maximum recursion depth exceeded"),
        (nested(500).encode(), "nested deeper than 33 levels"),  # parsed, but comparing or printing would recurse
        (json.dumps({"config": CONFIG, "trials": [{**TRIAL, "params": {"seed": 0}}]}).replace("0}", nested(500) + "}")
         .encode(), "nested deeper than 33 levels"),
        (b"\xff\xfe", "unreadable sweep state ('utf-8' codec can't decode"),
        (b"[]", "unreadable sweep state (list indices must be integers"),
        (b'"trials"', "unreadable sweep state (string indices must be integers"),
        (b"7", "unreadable sweep state ('int' object is not subscriptable)"),
        (b"null", "unreadable sweep state ('NoneType' object is not subscriptable)"),
        (b'{"trials": {"number": 1}}', "must be a mapping, not str"),
        (b'{"trials": [[1, 2]]}', "must be a mapping, not list"),
        (json.dumps({"trials": [{**TRIAL, "x" * 100_000: 1}]}).encode(), "unexpected keyword argument"),
        (json.dumps({"trials": [{**TRIAL, "number": list(range(100_000))}]}).encode(), "is not a whole number"),
        (json.dumps({"trials": [{**TRIAL, "run_dir": list(range(100_000))}]}).encode(), "run_dir [0, 1, 2"),
        (json.dumps({"trials": [{**TRIAL, "run_dir": {"a": "b"}}]}).encode(), "run_dir {'a': 'b'}"),
        (json.dumps({"trials": [{**TRIAL, "job_id": ["1"] * 100_000}]}).encode(), "job_id ['1', '1'"),
        (json.dumps({"trials": [{**TRIAL, "devices": {"0": 1}}]}).encode(), "devices {'0': 1}"),
        (json.dumps({"trials": [{**TRIAL, "params": ["seed"]}]}).encode(), "params=['seed']"),
        (json.dumps({"trials": [{**TRIAL, "params": {"seed": {"1": 2}}}]}).encode(), "params={'seed': {'1': 2}}"),
        (json.dumps({"trials": [{**TRIAL, "params": {"seed": [[1]]}}]}).encode(), "params={'seed': [[1]]}"),
        (json.dumps({"trials": [{**TRIAL, "command": {"a": 1}}]}).encode(), "command={'a': 1}"),
        (json.dumps({"trials": [{**TRIAL, "metric": [1.5]}]}).encode(), "metric=[1.5]"),
        (json.dumps({"trials": [{**TRIAL, "seconds": {"s": 1}}]}).encode(), "seconds={'s': 1}"),
        (json.dumps({"config": CONFIG, "trials": [{**TRIAL, "params": {"lr": 1}}]}).encode(), "params name 'lr'"),
    ],
)  # fmt: skip
def test_a_malformed_sweep_json_of_any_shape_ends_in_one_line(content: bytes, says: str, tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_bytes(content)
    error = opened(tmp_path)
    assert isinstance(error, SweepError), repr(error)
    message = str(error)
    assert message.startswith(f"{tmp_path / STATE_FILE}: ") and "\n" not in message and len(message) < 600, message
    assert says in message, message


@pytest.mark.parametrize("kind", KINDS)
def test_a_sweep_json_that_is_a_fifo_a_device_or_too_large_is_refused(
    kind: str, tmp_path: Path, hostile: Callable[[Path, str], Path]
) -> None:
    path = hostile(tmp_path / STATE_FILE, kind)
    assert f"{path}: is " in refusal(lambda: SweepState.open(tmp_path, CONFIG, tmp_path / "s.yaml"), SweepError, path)
    path.unlink()
    with path.open("wb") as file:
        file.truncate((64 << 20) + 1)  # sparse: nothing of it is read
    assert "more than the 67108864 bytes" in refusal(
        lambda: SweepState.open(tmp_path, CONFIG, tmp_path / "s.yaml"), SweepError, path
    )


def test_a_trial_run_folder_in_a_loop_of_links_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / STATE_FILE).write_text(json.dumps({"config": CONFIG, "trials": [{**TRIAL, "run_dir": "a"}]}))
    assert "run_dir 'a' is not a folder inside the sweep's" in str(opened(tmp_path))


@pytest.mark.parametrize("kind", KINDS)
def test_a_sweep_file_that_is_a_fifo_or_a_device_is_refused(
    kind: str, tmp_path: Path, hostile: Callable[[Path, str], Path]
) -> None:
    path = hostile(tmp_path / "sweep.yaml", kind)
    assert refusal(lambda: load_sweep(path), SweepError, path).startswith(f"{path}: is ")


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ("[" * 1_000, "cannot read the sweep file: maximum recursion depth exceeded"),  # deeper than YAML parses
        (nested(400), "nested deeper than 32 levels"),  # parsed, but its validation would recurse
    ],
)
def test_a_sweep_file_nested_too_deeply_is_refused_in_one_line(values: str, says: str, tmp_path: Path) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text(
        f"method: grid\ncommand: [aiayn-train, '${{args_no_hyphens}}']\nparameters:\n  seed:\n    values: {values}\n"
    )
    assert says in refusal(lambda: load_sweep(path), SweepError, path)


@pytest.mark.parametrize("kind", KINDS)
def test_a_job_status_or_a_trials_parameters_that_are_no_plain_file_count_as_none(
    kind: str, tmp_path: Path, hostile: Callable[[Path, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert outcome(lambda: read_exit_file(hostile(tmp_path / "trial-0001.exit.json", kind))) is None
    monkeypatch.setenv("WANDB_SWEEP_PARAM_PATH", str(hostile(tmp_path / "trial-0001.params.yaml", kind)))
    assert outcome(sweep_parameters) is None


def test_a_job_status_of_any_shape_counts_as_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "exit.json"
    for content in (b"[" * 100_000, b"\xff", b"[1]", b'{"returncode": "0"}', b" " * (1 << 17)):
        path.write_bytes(content)
        assert read_exit_file(path) is None
    path.write_bytes(b'{"returncode": 3}')
    assert read_exit_file(path) == 3
    monkeypatch.setenv("WANDB_SWEEP_PARAM_PATH", str(path))
    path.write_bytes(b"[" * 1_000)  # deeper than YAML parses
    assert sweep_parameters() is None


# -- a data cache ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_cache_manifest_that_is_a_fifo_or_a_device_is_damage_not_a_hang(
    kind: str, tmp_path: Path, hostile: Callable[[Path, str], Path]
) -> None:
    entry = CacheEntry(tmp_path / "spm.model", (tmp_path / "spm.model",))
    (tmp_path / "spm.model").write_bytes(b"model")
    hostile(entry.manifest, kind)
    assert outcome(entry.damage) == "spm.model.manifest.json cannot be read"
    entry.manifest.unlink()
    entry.manifest.write_bytes(b"[" * 100_000)
    assert entry.damage() == "spm.model.manifest.json cannot be read"
