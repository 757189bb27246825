"""A folder aiayn writes (a run's, a sweep's) holds no link, FIFO or device at any depth, save the links W&B
keeps in its own folder; what aiayn appends to or locks is opened without following a link or waiting on a
FIFO. Each case is refused in one line naming the path, and nothing outside the folder changes."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from aiayn.errors import DataError
from aiayn.files import (
    atomic_folder,
    atomic_write,
    hold_run_folder,
    open_for_append,
    own_folder,
    refuse_links,
    release_run_folder,
    run_folder_holder,
)


def victim(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "keep.txt").write_text("precious")
    return outside


def run_folder(tmp_path: Path) -> Path:
    """A run folder as a finished run leaves it, W&B's own links included."""
    run = tmp_path / "run"
    for name in (
        ".hydra/config.yaml",
        "checkpoints/last.ckpt",
        "csv/metrics.csv",
        "wandb/offline-run-1-ab/logs/debug.log",
    ):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("x")
    (run / "wandb" / "latest-run").symlink_to("offline-run-1-ab")
    (run / "wandb" / "debug.log").symlink_to("offline-run-1-ab/logs/debug.log")
    (run / "wandb" / "offline-run-1-ab" / "logs" / "debug-core.log").symlink_to("/root/.cache/wandb/logs/core.log")
    return run


def link(target: Path) -> Callable[[Path], None]:
    return lambda path: path.symlink_to(target)


def fifo(path: Path) -> None:
    os.mkfifo(path)


@pytest.mark.parametrize(
    "entry", [".hydra", ".hydra/config.yaml", "checkpoints/abandoned-after-step6", "csv/metrics.csv", "a/b/c/d"]
)
@pytest.mark.parametrize("kind", ["link", "FIFO"])
def test_a_link_or_fifo_at_any_depth_is_refused_naming_it(tmp_path: Path, entry: str, kind: str) -> None:
    run, outside = run_folder(tmp_path), victim(tmp_path)
    path = run / entry
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        for child in path.iterdir():
            child.unlink()
        path.rmdir()
    path.unlink(missing_ok=True)
    link(outside / "keep.txt")(path) if kind == "link" else fifo(path)
    with pytest.raises(DataError) as refused:
        refuse_links(run)
    what = "is a link" if kind == "link" else "is not a plain file or folder"
    assert str(refused.value).startswith(f"{path}: {what}") and "\n" not in str(refused.value)
    assert (outside / "keep.txt").read_text() == "precious"


def test_wandbs_own_links_pass_and_other_links_in_its_folder_do_not(tmp_path: Path) -> None:
    run, outside = run_folder(tmp_path), victim(tmp_path)
    refuse_links(run)  # W&B's latest-run and debug.log
    for name in ("run_id", "offline-run-1-ab/files/config.yaml", "offline-run-1-ab/logs/other.log"):
        path = run / "wandb" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(outside / "keep.txt")
        with pytest.raises(DataError, match=f"^{path}: is a link"):
            refuse_links(run)
        path.unlink()
    (run / "csv" / "debug.log").symlink_to(outside / "keep.txt")  # W&B's name, not in its folder
    with pytest.raises(DataError, match=r"debug\.log: is a link"):
        refuse_links(run)


def test_a_socket_or_a_device_link_is_refused(tmp_path: Path) -> None:
    run = run_folder(tmp_path)
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(run / "checkpoints" / "s"))
        with pytest.raises(DataError, match="s: is not a plain file or folder"):
            refuse_links(run)
    (run / "checkpoints" / "s").unlink()
    (run / "checkpoints" / "zero").symlink_to("/dev/zero")
    with pytest.raises(DataError, match="zero: is a link"):
        refuse_links(run)


def test_a_run_folder_with_a_deep_link_is_not_held(tmp_path: Path) -> None:
    run, outside = run_folder(tmp_path), victim(tmp_path)
    (run / ".hydra" / "hydra.yaml").symlink_to(outside / "keep.txt")
    with pytest.raises(DataError, match=r"hydra\.yaml: is a link"):
        hold_run_folder(run)
    assert run_folder_holder(run) is None  # not taken: the next process is refused the same way


@pytest.mark.parametrize("kind", ["link", "FIFO"])
def test_appending_refuses_a_link_or_a_fifo_without_waiting(tmp_path: Path, kind: str) -> None:
    outside = victim(tmp_path)
    path = tmp_path / "trial-1.log"
    link(outside / "keep.txt")(path) if kind == "link" else fifo(path)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(open_for_append, path)
        with pytest.raises(DataError, match=f"^{path}: is a "):
            future.result(timeout=10)
    assert (outside / "keep.txt").read_text() == "precious"
    plain = tmp_path / "plain.log"
    with open_for_append(plain) as log:
        log.write(b"a\n")
    with open_for_append(plain) as log:
        log.write(b"b\n")
    assert plain.read_bytes() == b"a\nb\n"


def test_a_folder_to_write_into_is_not_a_link(tmp_path: Path) -> None:
    outside = victim(tmp_path)
    (tmp_path / "aside").symlink_to(outside)
    with pytest.raises(DataError, match="aside: is a link"):
        own_folder(tmp_path / "aside")
    assert own_folder(tmp_path / "new").is_dir()


@pytest.mark.parametrize("kind", ["link", "FIFO"])
def test_a_lock_file_that_is_a_fifo_or_a_link_reads_as_held_at_once(tmp_path: Path, kind: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    link(victim(tmp_path) / "keep.txt")(run / "run.lock") if kind == "link" else fifo(run / "run.lock")
    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(run_folder_holder, run).result(timeout=10)
    assert holder is not None and holder.startswith("nobody: run.lock")
    with pytest.raises(DataError, match=r"run\.lock: is "):
        hold_run_folder(run)
    release_run_folder(run)


def test_a_new_folder_or_file_is_not_made_where_a_link_is(tmp_path: Path) -> None:
    outside = victim(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "export").symlink_to(empty)  # an export's folder: it would be made in the link's place
    with pytest.raises(DataError, match=r"export: is a link"):
        atomic_folder(tmp_path / "export", lambda folder: (folder / "model.bin").write_bytes(b"x"))
    (tmp_path / "report.json").symlink_to(outside / "keep.txt")
    with pytest.raises(DataError, match=r"report\.json: is a link"):
        atomic_write(tmp_path / "report.json", "{}")
    assert list(empty.iterdir()) == [] and (outside / "keep.txt").read_text() == "precious"
    assert (tmp_path / "report.json").is_symlink()


@pytest.mark.parametrize("kind", ["link", "FIFO"])
def test_every_path_of_a_real_run_folder_is_checked(smoke_run_dir: Path, tmp_path: Path, kind: str) -> None:
    """A link or a FIFO put in place of each file and folder a real run left, one at a time: the folder is
    refused naming it, and the place the link leads to is untouched."""
    outside = victim(tmp_path)
    entries = sorted(path.relative_to(smoke_run_dir) for path in smoke_run_dir.rglob("*") if path.name != "run.lock")
    assert len(entries) >= 15 and Path(".hydra/config.yaml") in entries
    for entry in entries:
        copy = tmp_path / "copy"
        shutil.copytree(smoke_run_dir, copy, symlinks=True, ignore=shutil.ignore_patterns("run.lock"))
        path = copy / entry
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        link(outside)(path) if kind == "link" else fifo(path)
        with pytest.raises(DataError) as refused:
            hold_run_folder(copy)
        assert str(refused.value).startswith(f"{path}: is "), entry
        shutil.rmtree(copy)
    assert sorted(outside.iterdir()) == [outside / "keep.txt"] and (outside / "keep.txt").read_text() == "precious"
