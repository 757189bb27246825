"""One W&B run per run folder: every part of a run (a continuation after SIGTERM, a requeued job) logs
to the id the folder keeps, at W&B steps that are the trainer's global steps, so that ``wandb sync``
joins offline parts into one history. The id is bound to its folder: a copy or a moved folder, and a
file that binds no id to the folder (garbage, a link, another folder's), log to a new W&B run, with one
warning; a new folder gets a new id whatever ``WANDB_RUN_ID`` a surrounding process left in the
environment."""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import wandb

from aiayn.config.compose import compose_run_config
from aiayn.errors import ConfigError, DataError
from aiayn.experiments.run import train
from aiayn.training.callbacks.preemption import Preempted
from aiayn.training.loggers.wandb_identity import RUN_ID_FILE, bind_run_id, bound_run_id, folder_run_id
from aiayn.training.loggers.wandb_logger import WandbRunLogger
from helpers.runs import smoke_run, train_in_process
from helpers.wandb_records import offline_runs

LOG_EVERY = 2  # debug=smoke's trainer.log_every_n_steps


class SigtermAfterStep(pl.Callback):
    """Sends this process SIGTERM once the optimizer has made ``step`` steps, as a scheduler would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.usefixtures("wandb_offline")
def test_a_run_continued_after_sigterm_logs_both_parts_to_one_wandb_run_with_continuing_steps(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_RUN_ID", "surrounding")  # left by a process around this one: not taken
    overrides = smoke_run(corpus_root, cache_dir, "logger=wandb")
    run_dir = tmp_path / "run"
    with pytest.raises(Preempted, match=r"^SIGTERM received: stopped after step \d+ and saved .*last\.ckpt;$"):
        train(compose_run_config(overrides), run_dir, overrides, callbacks=[SigtermAfterStep(5)])
    results = train(compose_run_config(overrides), run_dir, overrides)  # continues from last.ckpt

    first, second = offline_runs(run_dir / "wandb")
    stored = (run_dir / RUN_ID_FILE).read_text()
    assert stored == f"{first.run_id}\n{run_dir.resolve()}\n"  # the id, bound to its folder
    assert first.run_id == second.run_id != "surrounding"
    assert (first.exit_code, second.exit_code) == (1, 0)  # the stopped part counts as failed
    for part in (first, second):  # W&B's step is the trainer's, in every row: training, validation, media
        assert part.steps == [row["trainer/global_step"] for row in part.history]
        assert part.steps == sorted(set(part.steps))
    # part 1 logged steps 1 and 3 and stopped at 5; part 2 logs Lightning's step 5 (optimizer step 6) on
    assert first.steps[-1] < second.steps[0] <= first.steps[-1] + LOG_EVERY
    assert second.steps[-1] == results["steps"] == 12  # the evaluations after training, at the final step
    assert [row["_step"] for row in second.rows_with("val/samples/path")] == [5, 11]


def logged_part(folder: Path, step: int) -> str:
    """One part of a run in ``folder``, offline: its W&B run id."""
    logger = WandbRunLogger(save_dir=str(folder))
    logger.log_metrics({"train/loss": 1.5}, step=step)
    logger.finish(failed=False)
    return logger.run_id


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


def test_a_copied_or_moved_run_folder_logs_to_a_new_wandb_run_and_says_so_once(
    tmp_path: Path, wandb_offline: None, caplog: pytest.LogCaptureFixture
) -> None:
    original, copy, moved = tmp_path / "run1", tmp_path / "run2", tmp_path / "moved"
    first = logged_part(original, 3)
    assert logged_part(original, 7) == first  # a restart in the same folder continues its W&B run
    shutil.copytree(original, copy)  # cp -r run1 run2, then a resume in run2
    caplog.clear()
    second = logged_part(copy, 7)
    assert second != first
    (line,) = warnings_of(caplog)
    assert line == (
        f"{copy / RUN_ID_FILE}: W&B run {first} is the run of {str(original.resolve())!r}: this folder is a copy "
        f"of it, or moved; this folder logs to a new W&B run, {second}"
    )
    assert (copy / RUN_ID_FILE).read_text() == f"{second}\n{copy.resolve()}\n"  # the copy's own, from now on
    caplog.clear()
    assert logged_part(copy, 9) == second and logged_part(original, 9) == first and not warnings_of(caplog)
    assert [(run.run_id, run.steps) for run in offline_runs(copy / "wandb")] == [
        (first, [3]), (first, [7]), (second, [7]), (second, [9])  # the copied history, then the copy's own
    ]  # fmt: skip
    assert [run.run_id for run in offline_runs(original / "wandb")] == [first] * 3
    original.rename(moved)
    assert logged_part(moved, 11) not in (first, second)
    assert "this folder is a copy of it, or moved" in warnings_of(caplog)[-1]


@pytest.mark.parametrize(
    "content",
    [
        b"", b"a/b", b"../../etc", b"x" * 65, b"two words", b"abc\xffdef\n{folder}\n", b"\xff\xfe", b"id?x=1",
        b"abc123\n", b"abc123", b"abc123\n/elsewhere/run\n", b"abc123\n{folder}/..\n", b"abc123\n{folder}\n" * 2,
        b"abc123\n{folder}\n" + b"x" * 10_000_000,
    ],
    ids=[
        "empty", "slash", "parent", "too long", "space", "not ascii", "not text", "query", "no folder",
        "no folder, no end", "another folder", "a folder above", "two bindings", "huge",
    ],
)  # fmt: skip
def test_a_run_id_file_that_binds_no_id_to_its_folder_means_a_new_run_with_one_warning(
    content: bytes, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "run"
    path = folder / RUN_ID_FILE
    path.parent.mkdir(parents=True)
    path.write_bytes(content.replace(b"{folder}", os.fsencode(folder.resolve())))
    run_id = folder_run_id(folder)
    assert run_id.encode() not in content and len(run_id) == 8
    (line,) = warnings_of(caplog)
    assert line.startswith(f"{path}: ") and line.endswith(f"; this folder logs to a new W&B run, {run_id}")
    assert len(line) < 400 + len(str(path))  # what the file holds is shown cut short, in one line
    bind_run_id(folder, run_id)
    assert bound_run_id(folder) == (run_id, None)


def test_a_run_id_file_that_is_a_link_or_no_plain_file_is_never_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "run"
    path = folder / RUN_ID_FILE
    path.parent.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.write_text(f"abc123\n{folder.resolve()}\n")  # would bind the id to this folder, if it were followed
    path.symlink_to(outside)
    run_id = folder_run_id(folder)
    assert run_id != "abc123" and warnings_of(caplog) == [
        f"{path}: is a link; this folder logs to a new W&B run, {run_id}"
    ]
    bind_run_id(folder, run_id)  # replaces the link, not its target
    assert not path.is_symlink() and bound_run_id(folder) == (run_id, None)
    assert outside.read_text() == f"abc123\n{folder.resolve()}\n"
    path.unlink()
    path.symlink_to(path)  # a link to itself
    assert bound_run_id(folder) == (None, "is a link")
    bind_run_id(folder, run_id)
    assert bound_run_id(folder) == (run_id, None)
    path.unlink()
    os.mkfifo(path)  # would block a reader that opened it plainly
    assert bound_run_id(folder) == (None, "is a FIFO")
    bind_run_id(folder, run_id)
    assert bound_run_id(folder) == (run_id, None)
    path.unlink()
    path.mkdir()
    assert bound_run_id(folder) == (None, "is a folder")
    with pytest.raises(DataError) as refused:
        bind_run_id(folder, run_id)
    assert str(refused.value) == (
        f"{path}: cannot write the folder's W&B run id there (Is a directory); remove what is in its place, or "
        "make the folder writable"
    )


@pytest.mark.parametrize("name", ["wandb", ".wandb"])
def test_a_wandb_folder_that_is_a_link_is_refused_in_one_line(name: str, tmp_path: Path, wandb_offline: None) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).symlink_to(outside)  # W&B would write its runs there (and uses .wandb when it exists)
    with pytest.raises(DataError) as refused:
        WandbRunLogger(save_dir=str(run_dir))
    assert str(refused.value) == (
        f"{run_dir / name}: is a link; a run writes its logs only into its own folder: move it out of {run_dir}"
    )
    (run_dir / name).unlink()
    (run_dir / name).write_text("")
    with pytest.raises(DataError, match=r"/run/\.?wandb: is not a folder; a run writes its logs only into"):
        WandbRunLogger(save_dir=str(run_dir))
    assert list(outside.iterdir()) == []


def test_aiayn_train_refuses_a_wandb_folder_that_is_a_link_before_training(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, wandb_offline: None, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:  # fmt: skip
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    run_dir.mkdir()
    (run_dir / "wandb").symlink_to(outside)
    argv = [*smoke_run(corpus_root, cache_dir, "logger=wandb"), f"hydra.run.dir={run_dir}"]
    assert train_in_process(argv, monkeypatch) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"aiayn-train: error: {run_dir / 'wandb'}: is a link; a run writes ")
    assert f"move it out of {run_dir}" in line
    assert not (run_dir / "checkpoints").exists() and list(outside.iterdir()) == []


@pytest.mark.slow
def test_new_run_folders_get_new_ids_which_survive_the_fall_back_to_offline(
    tmp_path: Path, wandb_offline: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("WANDB_RUN_ID", "surrounding")
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)  # "logged in" ...
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # ... to a server that is not there

    def part(folder: Path, step: int) -> str:
        logger = WandbRunLogger(save_dir=str(folder), init_timeout=1)  # nothing to wait for at port 9
        assert logger.mode == "online"
        logger.log_metrics({"train/loss": 1.5}, step=step)
        logger.finish(failed=False)  # the online start failed: offline, with the folder's id
        return logger.run_id

    ids = [part(tmp_path / "a", 3), part(tmp_path / "b", 3)]
    assert ids[0] != ids[1] and "surrounding" not in ids
    assert [bound_run_id(tmp_path / name) for name in "ab"] == [(ids[0], None), (ids[1], None)]
    assert part(tmp_path / "a", 7) == ids[0]  # a second part of a, which says that the first is not uploaded
    assert f"1 offline parts of W&B run {ids[0]} are not uploaded yet" in caplog.text
    assert [(run.run_id, run.steps) for run in offline_runs(tmp_path / "a")] == [(ids[0], [3]), (ids[0], [7])]
    assert [(run.run_id, run.steps) for run in offline_runs(tmp_path / "b")] == [(ids[1], [3])]
    for run in [*offline_runs(tmp_path / "a"), *offline_runs(tmp_path / "b")]:  # whole runs, with what was logged
        assert run.exit_code == 0 and run.rows_with("train/loss")[0]["train/loss"] == 1.5


def test_under_a_sweep_agent_a_new_folder_takes_the_trials_id_and_a_stored_one_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweep1")  # what `wandb agent` sets for its trial
    monkeypatch.setenv("WANDB_RUN_ID", "trial123")
    assert folder_run_id(tmp_path / "new") == "trial123"
    bind_run_id(tmp_path / "old", "first99")
    assert folder_run_id(tmp_path / "old") == "first99"
    shutil.copytree(tmp_path / "old", tmp_path / "copy")
    assert folder_run_id(tmp_path / "copy") == "trial123"  # a copy is the trial's run
    monkeypatch.setenv("WANDB_RUN_ID", "../trial")
    with pytest.raises(ConfigError, match=r"^WANDB_RUN_ID=\.\./trial is not a W&B run id"):
        folder_run_id(tmp_path / "new")


def test_steps_an_online_w_b_run_holds_already_are_not_logged_again(tmp_path: Path, wandb_offline: None) -> None:
    # What the stand-in below assumes of W&B's Run: the first step it takes (after the steps a resumed
    # online run holds) as the property starting_step, and a log that takes the step.
    assert isinstance(inspect.getattr_static(wandb.sdk.wandb_run.Run, "starting_step"), property)
    assert {"data", "step"} <= set(inspect.signature(wandb.sdk.wandb_run.Run.log).parameters)
    logged: list[tuple[dict, int]] = []
    logger = WandbRunLogger(save_dir=str(tmp_path))
    # an online part whose W&B run holds steps 0-6 from an earlier part that logged past its checkpoint
    logger._experiment = SimpleNamespace(
        id=logger.run_id, starting_step=7, log=lambda data, step: logged.append((data, step))
    )
    for step in (5, 6, 7):
        logger.log_metrics({"train/loss": 1.0}, step=step)
    assert logged == [({"train/loss": 1.0, "trainer/global_step": 7}, 7)]
