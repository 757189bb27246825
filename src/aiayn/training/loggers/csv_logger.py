"""The CSV logger every run has: ``<run_dir>/csv/metrics.csv``, which a run that continues in its folder
(resumed, requeued) continues instead of starting again."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import IO

from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.loggers.logger import rank_zero_experiment

from aiayn.files import atomic_write, refuse_linked_paths
from aiayn.training.metrics import metric_columns, metric_rows


class ContinuedMetricsWriter(ExperimentWriter):
    """Lightning's CSV writer, but a run that continues in its folder (resumed, requeued) appends to
    ``metrics.csv`` instead of deleting the rows of its earlier parts, and rewrites it (for new columns)
    atomically, from its readable rows (:func:`metric_rows`): a kill while it rewrites loses nothing."""

    def _check_log_dir_exists(self) -> None:
        self.metrics_keys = metric_columns(Path(self.metrics_file_path))  # new keys rewrite the header

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        path = Path(self.metrics_file_path)

        def write(out: IO[bytes]) -> None:
            text = io.TextIOWrapper(out, encoding="utf-8", newline="")
            rows = csv.DictWriter(text, fieldnames=fieldnames)
            rows.writeheader()
            rows.writerows(metric_rows(path))
            text.flush()
            text.detach()  # atomic_write closes the file itself

        atomic_write(path, write)


class RunCSVLogger(CSVLogger):
    """``<run_dir>/csv/metrics.csv`` (:data:`~aiayn.training.metrics.METRICS_CSV`) with
    :class:`ContinuedMetricsWriter`. A run folder whose ``csv`` folder or files are links (or not folder
    and files) is refused (:func:`~aiayn.files.refuse_linked_paths`): Lightning's writers would follow
    them."""

    def __init__(self, save_dir: str, name: str = "csv", version: str = "") -> None:
        super().__init__(save_dir, name=name, version=version)
        files = (ContinuedMetricsWriter.NAME_METRICS_FILE, ExperimentWriter.NAME_HPARAMS_FILE)
        refuse_linked_paths(Path(save_dir), Path(self.log_dir), files)

    @property
    @rank_zero_experiment
    def experiment(self) -> ContinuedMetricsWriter:
        if self._experiment is None:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuedMetricsWriter(log_dir=self.log_dir)
        return self._experiment
