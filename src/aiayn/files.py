"""How aiayn writes files that others read: whole or not at all (:func:`atomic_write`), and one writer
per run folder (:func:`hold_run_folder`). Plain Python: every layer may import this module.

A run folder is held through ``fcntl.flock`` on its ``run.lock`` file for the life of the process that
writes it. The operating system releases the lock when that process ends, however it ends (SIGKILL,
an out-of-memory kill, a node's reboot), so a killed run never blocks its own resume; and the file
names its holder (host, process id, start time) for the message that refuses a second writer.

Both need the file system's help: a folder on one that has no file locks, or that refuses to sync a
folder to the disk, is refused in one line (:class:`~aiayn.errors.DataError`) naming the folder and the
fix, rather than written without the guarantees.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import glob
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

from aiayn.errors import DataError, RunFolderBusy

# A run folder's test translations, by the checkpoint tested (checkpoint.answer's kinds): aiayn-train writes
# them, aiayn-report pairs them.
TEST_TRANSLATIONS = {"evaluated": "test.hyp.txt", "averaged": "test.averaged.hyp.txt", "ema": "test.ema.hyp.txt"}

LOCK_FILE = "run.lock"
# What flock and fsync raise where the file system does not have them (NFS without its lock service,
# some FUSE and SMB mounts), as opposed to a lock that is taken or a disk that failed.
NO_LOCKS = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP})
NO_SYNC = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})
_HOST = socket.gethostname().replace(".", "-")  # no dots: they separate the parts of a temporary name
_UMASK = os.umask(0o022)  # read once: setting it later would change it for every thread for a moment
os.umask(_UMASK)
_held: dict[Path, int] = {}  # folder (resolved) → open descriptor of its lock file, for this process


# A line of a corpus or of a text to translate holds one sentence (or a document's segment): kilobytes.
LINE_BYTES = 1 << 20


class NotPlainFile(DataError):
    """A file that is not a plain file aiayn could read; ``why`` says what it is instead (``is a link``,
    ``is a FIFO``, ...), for messages of the callers' own."""

    def __init__(self, path: Path, why: str) -> None:
        self.why = why
        super().__init__(f"{path}: {why}" + (", not a plain file" if why.startswith("is ") else ""))


def open_plain(path: Path, *, follow_links: bool = False) -> IO[bytes]:
    """``path`` open for reading when it is a plain file, else a :class:`NotPlainFile` naming it: a FIFO,
    a device or a socket (reading one could block, or never end), and a link unless ``follow_links`` (a
    link in a folder aiayn writes is never aiayn's, and may lead anywhere; a file the user names, such
    as a corpus, may be a link to a plain file). Nothing there is a :class:`FileNotFoundError`."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)  # O_NONBLOCK: opening a FIFO that nobody writes would wait forever
    except OSError as error:
        if error.errno in (errno.ENOENT, errno.ENOTDIR):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path)) from None
        if error.errno == errno.ELOOP and not follow_links:
            raise NotPlainFile(path, "is a link") from None
        raise NotPlainFile(path, f"cannot be read ({error.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotPlainFile(path, f"is {_kind(mode)}")
    os.set_blocking(fd, True)  # a plain file: some network file systems would answer EAGAIN otherwise
    return os.fdopen(fd, "rb")


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a folder" if stat.S_ISDIR(mode) else "something else"


def read_plain_file(path: Path, limit: int, *, follow_links: bool = False) -> bytes:
    """The bytes of the plain file ``path`` (:func:`open_plain`), when it has at most ``limit`` of them; a
    larger file is a :class:`DataError` naming it, found having read ``limit`` + 1 bytes at most."""
    with open_plain(path, follow_links=follow_links) as file:
        size = os.fstat(file.fileno()).st_size
        if size > limit:
            raise _too_large(path, limit)
        content = file.read(size + 1)  # sized by the file, not the limit: a read's buffer is as large as asked
        if len(content) > size:  # grown since, or of a size the system does not know (/proc): read on
            content += file.read(limit + 1 - len(content))
    if len(content) > limit:
        raise _too_large(path, limit)
    return content


def _too_large(path: Path, limit: int) -> DataError:
    return DataError(f"{path}: more than the {limit} bytes such a file has")


def bounded_lines(stream: IO[bytes], name: str, limit: int = LINE_BYTES) -> Iterator[bytes]:
    """The lines of ``stream`` without their line feeds, each read only while it has at most ``limit``
    bytes: a longer one is a :class:`DataError` (``<name>:<line>``) once ``limit`` + 1 of its bytes are
    read, so that a runaway line (a file of no line feeds, inflated from a small ``.gz``) never fills
    the memory."""
    for number, line in enumerate(iter(functools.partial(stream.readline, limit + 1), b""), start=1):
        if line.endswith(b"\n"):
            yield line[:-1]
        elif len(line) > limit:
            raise DataError(f"{name}:{number}: a line of more than {limit} bytes; a line holds one sentence")
        else:
            yield line  # the last, without a line feed


def open_for_append(path: Path) -> IO[bytes]:
    """``path`` open for appending (created when missing) when it is a plain file: a link is refused, not
    written through, and a FIFO is not waited on (:class:`~aiayn.errors.DataError`, naming it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENXIO):  # ENXIO: a FIFO that nobody reads
            raise
        raise DataError(f"{path}: is a {'link' if error.errno == errno.ELOOP else 'FIFO'}; aiayn appends only to "
                        "plain files of its own: remove it") from None  # fmt: skip
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DataError(f"{path}: is not a plain file; aiayn appends only to plain files of its own: remove it")
    return os.fdopen(fd, "ab")


def atomic_write(path: Path, content: str | bytes | Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` whole or not at all: into a temporary file of its own folder, flushed to the disk,
    then renamed over ``path``. ``content`` is text (UTF-8), bytes, or a function that writes into the
    open binary file. A reader sees the old file or the new one, never a part. A link at ``path`` is
    refused (:class:`~aiayn.errors.DataError`).

    The temporary file's name holds this host and process (``.<name>.<host>.<pid>.<random>.tmp``): a
    writer removes the ones that writers of this host left when they died (a checkpoint's can be
    gigabytes), never one that a living writer is still filling."""
    path = Path(path)
    if path.is_symlink():  # whoever made it meant the writes to go elsewhere: neither follow nor drop it
        raise DataError(
            f"{path}: is a link; aiayn writes only plain files of its own there: remove it or write elsewhere"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with temporary_file(path.parent, path.name) as tmp:
        try:
            if callable(content):
                content(tmp)
            else:
                tmp.write(content.encode("utf-8") if isinstance(content, str) else content)
            tmp.flush()
            _sync(tmp.fileno(), path.parent)
        except BaseException:
            os.unlink(tmp.name)
            raise
    try:
        found = path.lstat()  # not followed: a link made since the check above is replaced, its target kept
        mode = found.st_mode & 0o7777 if stat.S_ISREG(found.st_mode) else 0o666 & ~_UMASK
    except FileNotFoundError:
        mode = 0o666 & ~_UMASK  # a new one gets an ordinary file's, not the temporary file's 0600
    os.chmod(tmp.name, mode)
    os.replace(tmp.name, path)
    _sync_folder(path.parent)  # the rename itself reaches the disk


def temporary_file(folder: Path, name: str) -> IO[bytes]:
    """A new file in ``folder``, open for writing, that its writer renames or removes when done: named
    ``.<name>.<host>.<pid>.<random>.tmp``, so that the next writer of ``name`` in ``folder`` on this
    host removes it if its process died first (killed while it filled a checkpoint or a split's token
    ids, which can be gigabytes). Those that writers of ``name`` left are removed here; a living
    writer's never."""
    prefix = f".{name}.{_HOST}."
    _remove_orphans(Path(folder), prefix)
    return tempfile.NamedTemporaryFile(dir=folder, prefix=f"{prefix}{os.getpid()}.", suffix=".tmp", delete=False)


def holds_files(path: Path) -> bool:
    """``path`` is a file, or a folder with something in it: not where a new folder may go."""
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def atomic_folder(path: Path, write: Callable[[Path], None]) -> None:
    """Make the new folder ``path`` whole or not at all: ``write(folder)`` fills a temporary folder beside
    it (``.<name>.<host>.<pid>.<random>.tmp``, as :func:`atomic_write` names its files), which is then
    renamed to ``path``. ``path`` must not exist, or be an empty folder; a folder with files in it is a
    :class:`FileExistsError`, and nothing is written into it. Temporary folders that writers of this
    host left when they died are removed."""
    path = Path(path)
    if path.is_symlink():
        raise DataError(f"{path}: is a link; aiayn makes a new folder of its own there: remove it or write elsewhere")
    if holds_files(path):
        raise FileExistsError(f"{path} already exists and is not empty")
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{path.name}.{_HOST}."
    _remove_orphans(path.parent, prefix)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{prefix}{os.getpid()}.", suffix=".tmp"))
    try:
        write(staging)
        os.chmod(staging, 0o777 & ~_UMASK)  # an ordinary folder's permissions, not mkdtemp's 0700
        if path.is_dir():
            path.rmdir()  # empty, checked above: a folder that filled since makes this fail
        os.rename(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _sync_folder(path.parent)  # the rename itself reaches the disk


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        _sync(fd, folder)
    finally:
        os.close(fd)


def _sync(fd: int, folder: Path) -> None:
    """``os.fsync(fd)``, of a file in ``folder`` or of the folder itself; a file system that cannot
    (EINVAL: some FUSE, SMB and 9p mounts refuse it for folders) is a :class:`DataError`."""
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in NO_SYNC:
            raise
        raise DataError(
            f"folder {folder} is on a file system that refuses fsync ({error.strerror or error}), so what aiayn "
            "writes there could be lost or cut short by a crash: choose a folder on a local disk (hydra.run.dir=, "
            "hydra.sweep.dir=, data.cache_dir= or the output path the command takes)"
        ) from error


def _remove_orphans(folder: Path, prefix: str) -> None:
    """Remove ``folder``'s temporary files (and folders) named ``<prefix><pid>.*.tmp`` whose process has
    ended."""
    for leftover in folder.glob(f"{glob.escape(prefix)}*.tmp"):
        pid = leftover.name[len(prefix) :].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's living process
    return True


def same_file(a: Path, b: Path) -> bool:
    """``a`` and ``b`` are one file (the same path, a link to it, or the same inode)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def hold_run_folder(folder: Path) -> bool:
    """Take ``folder``'s lock for the rest of this process's life (creating the folder); False when this
    process holds it already. Raises :class:`~aiayn.errors.RunFolderBusy`, naming the holder, when
    another process does, and :class:`~aiayn.errors.DataError` when the folder's file system has no
    locks (then nothing made here is left)."""
    folder = Path(folder)
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    key = folder.resolve()
    if key in _held:
        return False
    refuse_links(folder)
    created = not (folder / LOCK_FILE).exists()
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # made in the moment since refuse_links looked
        os.close(fd)
        raise DataError(f"{folder / LOCK_FILE}: is not a plain file; remove it (or start the run in another folder)")
    deadline = time.monotonic() + 1.0  # run_folder_holder's shared lock of a moment is not a holder
    while True:
        try:
            _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, folder)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            holder = _read_holder(fd)
            os.close(fd)
            raise RunFolderBusy(folder, holder) from None
        except DataError:  # a file system without locks: what was made for the lock goes again
            os.close(fd)
            if created:
                (folder / LOCK_FILE).unlink(missing_ok=True)
            if made:
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise
    os.ftruncate(fd, 0)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n".encode(), 0)
    _held[key] = fd
    return True


def refuse_links(folder: Path) -> None:
    """A :class:`~aiayn.errors.DataError` when anything in the run (or sweep) folder ``folder``, at any
    depth, is a link, or neither a plain file nor a folder (a FIFO, a device, a socket): aiayn never makes
    one there, Hydra, the loggers and the checkpoints write through links (a linked ``.hydra/config.yaml``
    is a file elsewhere overwritten, a linked ``checkpoints/`` another run's pruned), and opening a FIFO
    blocks. A copied or shared folder may hold them. Checked once, by the process that holds the folder
    (nothing else writes there while it does), before anything is written; the links W&B keeps in its own
    folder (:func:`_wandb_link`) are the one exception."""
    folder = Path(folder)
    pending = [folder]
    while pending:
        current = pending.pop()
        try:
            entries = sorted(os.scandir(current), key=lambda entry: entry.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            path = Path(entry.path)
            if entry.is_symlink():
                if _wandb_link(folder, path):
                    continue
                raise DataError(
                    f"{path}: is a link; a run writes only into its own folder: move it out of {folder} "
                    "(or start the run in another folder)"
                )
            if entry.is_dir(follow_symlinks=False):
                pending.append(path)
            elif not entry.is_file(follow_symlinks=False):
                raise DataError(
                    f"{path}: is not a plain file or folder (a FIFO, a device or a socket); aiayn reads and writes "
                    f"only plain files in {folder}: remove it (or start the run in another folder)"
                )


# Where W&B writes in a run folder (.wandb instead of wandb when it exists), and the links it makes
# there: ``latest-run``, ``debug.log`` and ``debug-internal.log`` point at its newest run and are replaced
# by a rename; ``debug-core.log`` in a run's ``logs/`` points at its service's log and is made in each new
# run's folder. None is written through.
WANDB_FOLDERS = ("wandb", ".wandb")
WANDB_LINKS = frozenset({"latest-run", "debug.log", "debug-internal.log", "debug-core.log"})


def _wandb_link(folder: Path, path: Path) -> bool:
    """``path`` is one of the links W&B makes, in a W&B folder under ``folder``."""
    inside = path.relative_to(folder).parts[:-1]
    return path.name in WANDB_LINKS and any(part in WANDB_FOLDERS for part in inside)


def own_folder(path: Path) -> Path:
    """The folder ``path`` (made when missing) when it is a folder, not a link to one: aiayn is about to
    write into it. A :class:`~aiayn.errors.DataError` names what is there instead."""
    path = Path(path)
    path.mkdir(exist_ok=True)
    if path.is_symlink() or not path.is_dir():
        raise DataError(f"{path}: is {'a link' if path.is_symlink() else 'not a folder'}; aiayn writes only into "
                        "folders of its own: move it away")  # fmt: skip
    return path


def refuse_linked_paths(root: Path, folder: Path, files: Sequence[str] = ()) -> None:
    """A :class:`~aiayn.errors.DataError` when a folder on the way from the run folder ``root`` to its ``folder`` is a
    link or not a folder, or one of ``files`` in it a link or not a plain file: a logger writes there, and
    a link in a copied or shared run folder would make it write outside the run folder. A ``folder`` that
    is not in ``root`` is one the user named: theirs, not checked."""
    try:
        parts = Path(folder).relative_to(root).parts
    except ValueError:
        return
    folders = [(root.joinpath(*parts[:n]), stat.S_ISDIR) for n in range(1, len(parts) + 1)]
    for path, kind in folders + [(Path(folder) / name, stat.S_ISREG) for name in files]:
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            if kind is stat.S_ISDIR:
                return  # nothing in it either: what the logger writes there is new
            continue
        except OSError as error:
            raise DataError(f"{path}: cannot be read ({error.strerror}); the run writes there") from None
        if not kind(mode):
            what = "a link" if stat.S_ISLNK(mode) else "not a folder" if kind is stat.S_ISDIR else "not a plain file"
            raise DataError(f"{path}: is {what}; a run writes its logs only into its own folder: move it out of {root}")


def held_folders() -> set[Path]:
    """The run folders (resolved) this process holds now."""
    return set(_held)


def release_run_folder(folder: Path) -> None:
    """Give up ``folder``'s lock (a run that ends inside a longer process: a test, a notebook)."""
    fd = _held.pop(Path(folder).resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the flock


@contextlib.contextmanager
def run_folder_held(folder: Path) -> Iterator[None]:
    """:func:`hold_run_folder` for the duration of the block, unless this process held it before."""
    taken = hold_run_folder(folder)
    try:
        yield
    finally:
        if taken:
            release_run_folder(folder)


def run_folder_holder(folder: Path) -> str | None:
    """Who holds ``folder`` (``pid 123 on node7, since ...``), or None when no living process does. A lock
    file that is a link, a FIFO or a device is read as held (by nobody): no run can take that folder."""
    own = _held.get(Path(folder).resolve())
    if own is not None:
        return _read_holder(own)
    try:
        fd = os.open(Path(folder) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as error:  # a link (ELOOP): not a lock aiayn made, so not a folder to take
        return f"nobody: {LOCK_FILE} cannot be read ({error.strerror})"
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO would never answer a read
        os.close(fd)
        return f"nobody: {LOCK_FILE} is not a plain file"
    try:
        _flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, Path(folder))
    except BlockingIOError:
        return _read_holder(fd)
    finally:
        os.close(fd)  # a shared lock taken here is released with the descriptor
    return None


def _flock(fd: int, operation: int, folder: Path) -> None:
    """``fcntl.flock`` on the lock file of the run folder ``folder``; a file system without locks is a
    :class:`DataError` (a taken lock stays a :class:`BlockingIOError`)."""
    try:
        fcntl.flock(fd, operation)
    except OSError as error:
        if error.errno not in NO_LOCKS:
            raise
        raise DataError(
            f"run folder {folder} is on a file system without file locks (flock: {error.strerror or error}), "
            "which aiayn needs to keep a second process from writing the run: put the run on a local disk or "
            "a file system with locks (NFS with its lock service), with hydra.run.dir= (hydra.sweep.dir= for -m)"
        ) from error


def _read_holder(fd: int) -> str:
    text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    return text or "another process"
