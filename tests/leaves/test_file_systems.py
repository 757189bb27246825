"""A folder on a file system that lacks what aiayn's guarantees rest on (file locks for one writer per run
folder, fsync for files whole after a crash) is refused in one line naming the folder and the fix, with
exit status 2 and nothing left behind; other errors of the storage stay what they are.

No such file system is at hand, so its answer is given at the system call: ``fcntl.flock`` or
``os.fsync`` raise the error that NFS without its lock service, FUSE, SMB or 9p mounts raise."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from aiayn.errors import DataError
from aiayn.files import atomic_folder, atomic_write, hold_run_folder, run_folder_holder
from helpers.runs import smoke_run, train_in_process

REAL_FLOCK, REAL_FSYNC = fcntl.flock, os.fsync


def without_locks(monkeypatch: pytest.MonkeyPatch, code: int, folder: Path | None = None) -> None:
    """``fcntl.flock`` raises ``code`` for the lock file of ``folder`` (of every folder when None)."""

    def flock(fd: int, operation: int) -> None:
        if folder is None or Path(os.readlink(f"/proc/self/fd/{fd}")).parent == folder:
            raise OSError(code, os.strerror(code))
        REAL_FLOCK(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)


def refusing_folder_fsync(monkeypatch: pytest.MonkeyPatch, code: int, under: Path) -> None:
    """``os.fsync`` of a folder under ``under`` raises ``code``; files, and folders elsewhere, sync."""

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode) and Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(under):
            raise OSError(code, os.strerror(code))
        REAL_FSYNC(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP], ids=errno.errorcode.get)
@pytest.mark.parametrize("named", [True, False], ids=["hydra.run.dir", "a fresh run folder"])
def test_a_run_on_a_file_system_without_locks_ends_in_one_line(
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    code: int,
    named: bool,
) -> None:
    monkeypatch.chdir(tmp_path)
    run_dir, runs = tmp_path / "run", Path("outputs") / "nolocks"  # a fresh one: outputs/<name>/<start time>
    without_locks(monkeypatch, code)
    argv = [*smoke_run(corpus_root, cache_dir, "name=nolocks"), *([f"hydra.run.dir={run_dir}"] if named else [])]
    assert train_in_process(argv, monkeypatch) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"aiayn-train: error: run folder {run_dir if named else runs / ''}"), line
    assert f" is on a file system without file locks (flock: {os.strerror(code)}), " in line
    assert line.endswith("put the run on a local disk or a file system with locks (NFS with its lock service), "
                         "with hydra.run.dir= (hydra.sweep.dir= for -m)")  # fmt: skip
    assert not run_dir.exists() and list(runs.glob("*")) == []  # the folder made for the run is gone again


@pytest.mark.parametrize("job", [False, True], ids=["the multirun's folder", "a job's folder"])
def test_a_multirun_on_a_file_system_without_locks_ends_in_one_line(
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    job: bool,
) -> None:
    sweep = tmp_path / "multirun"
    folder = sweep / "0" if job else sweep
    without_locks(monkeypatch, errno.ENOLCK, folder)
    assert train_in_process(["-m", f"hydra.sweep.dir={sweep}", *smoke_run(corpus_root, cache_dir)], monkeypatch) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"aiayn-train: error: run folder {folder} is on a file system without file locks (flock: ")
    assert line.endswith("with hydra.run.dir= (hydra.sweep.dir= for -m)")
    assert not folder.exists()  # no lock file, no .hydra/, no multirun.yaml


def test_asking_who_holds_a_folder_on_a_file_system_without_locks_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "run.lock").touch()  # a run folder made elsewhere (resume=true and aiayn-sweep ask)
    without_locks(monkeypatch, errno.ENOSYS)
    with pytest.raises(DataError, match=f"^run folder {tmp_path} is on a file system without file locks"):
        run_folder_holder(tmp_path)
    with pytest.raises(DataError):
        hold_run_folder(tmp_path)
    assert [path.name for path in tmp_path.iterdir()] == ["run.lock"]  # the folder's own lock file is kept


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EOPNOTSUPP], ids=errno.errorcode.get)
@pytest.mark.parametrize(
    "write",
    [
        lambda path: atomic_write(path / "results.json", "{}\n"),
        lambda path: atomic_write(path / "last.ckpt", lambda out: out.write(b"\0" * 1000)),
        lambda path: atomic_folder(path / "export", lambda folder: (folder / "config.json").write_text("{}")),
    ],
    ids=["text", "streamed", "folder"],
)
def test_a_folder_whose_file_system_refuses_fsync_is_named_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, write: Callable[[Path], None]
) -> None:
    refusing_folder_fsync(monkeypatch, code, tmp_path)
    with pytest.raises(DataError) as refused:
        write(tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"folder {tmp_path} is on a file system that refuses fsync ({os.strerror(code)})")
    assert message.endswith("choose a folder on a local disk (hydra.run.dir=, hydra.sweep.dir=, data.cache_dir= "
                            "or the output path the command takes)")  # fmt: skip
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file or folder left behind


def test_other_storage_errors_are_not_taken_for_a_missing_feature(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError) as failed:
        atomic_write(tmp_path / "results.json", "{}\n")
    assert failed.type is OSError and failed.value.errno == errno.EIO  # reported as an I/O error (exit 74)
    assert list(tmp_path.iterdir()) == []


def test_a_run_whose_cache_folder_refuses_fsync_ends_in_one_line(
    tmp_path: Path,
    corpus_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cache = tmp_path / "cache"
    refusing_folder_fsync(monkeypatch, errno.EINVAL, cache)
    argv = [*smoke_run(corpus_root, cache), f"hydra.run.dir={tmp_path / 'run'}"]
    assert train_in_process(argv, monkeypatch) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"aiayn-train: error: folder {cache}/"), line
    assert "is on a file system that refuses fsync (Invalid argument)" in line and "data.cache_dir=" in line
