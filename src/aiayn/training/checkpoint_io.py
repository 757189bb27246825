"""Lightning's checkpoint input/output for a training run, over :mod:`aiayn.training.checkpoints`' atomic
writes, ``weights_only`` reads and confined deletions. Apart from that module because it is the one part of
checkpoints that needs Lightning: the commands that only read or average checkpoints do without it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO

from aiayn.training.checkpoints import load_checkpoint, remove_plain_file, save_checkpoint


class RunCheckpointIO(CheckpointIO):
    """Lightning's checkpoint input/output for a run: :func:`save_checkpoint`'s atomic writes and
    :func:`load_checkpoint`'s ``weights_only`` reads (or the user's own ``inner`` input/output, e.g. for
    cloud storage), every checkpoint read passed through ``check`` before Lightning restores any of
    it (:class:`~aiayn.training.restored_state.RestoredState`), and deletions confined to ``folder``,
    the run's ``checkpoints/``: a checkpoint tracker (``ModelCheckpoint``) deletes through here, and
    its list of files comes from checkpoints people share."""

    def __init__(
        self,
        folder: Path,
        check: Callable[[dict[str, Any], Path], dict[str, Any]] | None = None,
        inner: CheckpointIO | None = None,
    ) -> None:
        self.folder, self.check, self.inner = Path(folder), check, inner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if self.inner is not None:
            self.inner.save_checkpoint(checkpoint, path, storage_options)
        else:
            save_checkpoint(checkpoint, Path(path))

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        # Lightning's strategies pass no map_location: tensors load on the CPU, then move with the module.
        if self.inner is not None:
            checkpoint = self.inner.load_checkpoint(path, map_location, weights_only=True)
        else:
            checkpoint = load_checkpoint(Path(path))
        return self.check(checkpoint, Path(path)) if self.check is not None else checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        remove_plain_file(path, self.folder)

    def teardown(self) -> None:
        if self.inner is not None:
            self.inner.teardown()
