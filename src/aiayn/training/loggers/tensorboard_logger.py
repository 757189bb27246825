"""TensorBoard (``logger=tensorboard``): Lightning's logger, with one event file per run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from aiayn.files import refuse_linked_paths


class TensorBoardRunLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger with one event file per run. Lightning finalizes loggers after fit
    and again after test; closing the writer after fit makes the test's scalars open a second file, and
    when fit took under a second both carry the same name (``events.out.tfevents.<second>.<host>``): the
    second replaces the first. Here Lightning's finalize only flushes; :meth:`close` ends the file. A log
    folder or ``hparams.yaml`` that is a link is refused (:func:`~aiayn.files.refuse_linked_paths`)."""

    def __init__(self, save_dir: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(save_dir, *args, **kwargs)
        refuse_linked_paths(Path(save_dir), Path(self.log_dir), ("hparams.yaml",))

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._experiment is not None:
            self._experiment.flush()

    def close(self, status: str) -> None:
        super().finalize(status)
