"""What the loggers read back from a run folder, which may be a copy or someone else's: damaged metric
rows are dropped with one warning, a file that is no metrics CSV is refused in one line naming it, and
no logger reads or writes through a link or into a FIFO."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from aiayn.errors import DataError
from aiayn.training.loggers.csv_logger import ContinuedMetricsWriter, RunCSVLogger
from aiayn.training.loggers.tensorboard_logger import TensorBoardRunLogger
from aiayn.training.metrics import METRIC_ROW_BYTES, METRICS_CSV, drop_metrics_from, metric_rows
from helpers.runs import smoke_run, train_in_process

HEADER = b"epoch,step,train/loss\r\n"
FIX = "move it out of the run folder to continue the run without its earlier metric rows"


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


def test_damaged_metric_rows_are_dropped_with_one_warning_and_the_rows_kept_intact(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics.csv"
    damaged = [
        b"0,2,\xff\xfe\r\n",  # not UTF-8
        b"0,2,4.5,extra\r\n",  # not of the header's width
        b"0,inf,4.0\r\n",  # steps that are no whole numbers
        b"0,nan,4.0\r\n",
        b"0,1e400,4.0\r\n",
        b"0,2.5,4.0\r\n",
        b"0,two,4.0\r\n",
        b'0,2,"open quote\r\n',
        b"0," + b"9" * (METRIC_ROW_BYTES + 10) + b",1.0\r\n",  # longer than a row: skipped unread
        b"0,3," + b"1" * 200_000 + b"\r\n",  # a field over csv's limit
    ]
    good = [b"0,1,5.0\r\n", b"0,3,4.0\r\n", b"0,5,3.5\r\n"]
    later = [b"0,6,3.0\r\n", b"0,8,2.0\r\n"]
    path.write_bytes(
        HEADER + good[0] + b"".join(damaged[:5]) + good[1] + b"".join(damaged[5:]) + good[2] + b"".join(later)
    )
    assert drop_metrics_from(path, 6) == len(damaged) + len(later)
    assert path.read_bytes() == b"epoch,step,train/loss\n0,1,5.0\n0,3,4.0\n0,5,3.5\n"
    assert warnings_of(caplog) == [
        f"{path}: dropped {len(damaged)} lines that are not rows of its columns (damaged, or not CSV)"
    ]


def test_a_row_cut_short_by_a_kill_goes_without_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "metrics.csv"
    path.write_bytes(HEADER + b"0,1,5.0\r\n0,2")
    assert drop_metrics_from(path, 6) == 1
    assert path.read_bytes() == b"epoch,step,train/loss\n0,1,5.0\n" and not warnings_of(caplog)
    path.write_bytes(HEADER + b"0,1,5.0")  # cut at the end of the row: kept, and its line ended
    assert drop_metrics_from(path, 6) == 0 and path.read_bytes() == b"epoch,step,train/loss\n0,1,5.0\n"
    path.write_bytes(b"")  # killed before the header
    assert drop_metrics_from(path, 6) == 0 and path.read_bytes() == b""


@pytest.mark.parametrize(
    "content",
    [b"\xff\xfe\x00\x01garbage\n0,1\n", b"epoch,loss\n0,1.0\n", b"x" * (METRIC_ROW_BYTES + 1), b'"step\n'],
    ids=["binary", "no step column", "one huge line", "open quote"],
)
def test_a_file_that_is_no_metrics_csv_is_refused_in_one_line(content: bytes, tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_bytes(content)
    message = f"{path}: its first line is not the header of a metrics CSV (no 'step' column); {FIX}"
    with pytest.raises(DataError) as refused:
        drop_metrics_from(path, 6)
    assert str(refused.value) == message
    with pytest.raises(DataError) as refused:
        list(metric_rows(path))
    assert str(refused.value) == message
    assert path.read_bytes() == content


@pytest.mark.parametrize("kind", ["link", "fifo", "folder"])
def test_a_metrics_file_that_is_a_link_or_no_plain_file_is_neither_read_nor_written(kind: str, tmp_path: Path) -> None:
    outside = tmp_path / "outside.csv"
    outside.write_bytes(HEADER + b"0,1,5.0\r\n0,7,1.0\r\n")
    run_dir = tmp_path / "run"
    path = run_dir / METRICS_CSV
    path.parent.mkdir(parents=True)
    {"link": lambda: path.symlink_to(outside), "fifo": lambda: os.mkfifo(path), "folder": path.mkdir}[kind]()
    what = {"link": "is a link", "fifo": "is a FIFO", "folder": "is a folder"}[kind]
    with pytest.raises(DataError) as refused:
        drop_metrics_from(path, 6)  # a FIFO opened plainly would block here
    assert str(refused.value) == f"{path}: {what}; {FIX}"
    with pytest.raises(DataError) as refused:
        RunCSVLogger(str(run_dir))
    what = "a link" if kind == "link" else "not a plain file"
    assert (
        str(refused.value)
        == f"{path}: is {what}; a run writes its logs only into its own folder: move it out of {run_dir}"
    )
    assert outside.read_bytes() == HEADER + b"0,1,5.0\r\n0,7,1.0\r\n"


@pytest.mark.parametrize("link", ["csv", "csv/hparams.yaml", "tensorboard", "tensorboard/hparams.yaml"])
def test_loggers_refuse_a_run_folder_whose_log_folders_or_files_are_links(link: str, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    run_dir = tmp_path / "run"
    (run_dir / link).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / link).symlink_to(outside / "target")
    logger = RunCSVLogger if link.startswith("csv") else TensorBoardRunLogger
    with pytest.raises(DataError) as refused:
        logger(str(run_dir), name=link.split("/")[0], version="")
    assert (
        str(refused.value)
        == f"{run_dir / link}: is a link; a run writes its logs only into its own folder: move it out of {run_dir}"
    )
    assert list(outside.iterdir()) == []


def test_a_continued_csv_log_with_new_columns_keeps_its_readable_rows(tmp_path: Path) -> None:
    folder = tmp_path / "csv"
    folder.mkdir()
    (folder / "metrics.csv").write_bytes(HEADER + b"0,1,5.0\r\n\xff,2,4.0\r\n0,3,4.5\r\n")
    writer = ContinuedMetricsWriter(str(folder))
    assert writer.metrics_keys == ["epoch", "step", "train/loss"]
    writer.log_metrics({"val/bleu": 1.5}, step=4)  # a new column: the file is rewritten, atomically
    writer.save()
    assert (folder / "metrics.csv").read_bytes() == (
        b"epoch,step,train/loss,val/bleu\r\n0,1,5.0,\r\n0,3,4.5,\r\n,4,,1.5\r\n"
    )
    assert [name for name in os.listdir(folder) if name != "metrics.csv"] == []  # no temporary file left


def test_aiayn_train_refuses_a_folder_whose_metrics_are_no_csv_before_training(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    (run_dir / METRICS_CSV).parent.mkdir(parents=True)
    (run_dir / METRICS_CSV).write_bytes(b"\x00\x01\x02 not metrics\n")
    argv = [*smoke_run(corpus_root, cache_dir), f"hydra.run.dir={run_dir}"]
    assert train_in_process(argv, monkeypatch) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"aiayn-train: error: {run_dir / METRICS_CSV}: its first line is not the header of a metrics CSV (no 'step' "
        f"column); {FIX}"
    )
    assert not (run_dir / "checkpoints").exists()
