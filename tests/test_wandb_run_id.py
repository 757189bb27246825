"""One W&B run per run folder: every part of a run (a continuation after SIGTERM, a requeued job) logs
to the id the folder keeps, at W&B steps that are the trainer's global steps, so that ``wandb sync``
joins offline parts into one history; a stored id that is not an id is refused, and a new folder gets a
new id whatever ``WANDB_RUN_ID`` a surrounding process left in the environment."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl

from aiayn.config.compose import compose_run_config
from aiayn.errors import ConfigError, DataError
from aiayn.experiments.run import train
from aiayn.training.callbacks.preemption import Preempted
from aiayn.training.loggers import RUN_ID_FILE, WandbRunLogger, folder_run_id
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


@pytest.mark.usefixtures("wandb_offline")
def test_a_run_continued_after_sigterm_logs_both_parts_to_one_wandb_run_with_continuing_steps(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_RUN_ID", "surrounding")  # left by a process around this one: not taken
    overrides = smoke_run(corpus_root, cache_dir, "logger=wandb")
    run_dir = tmp_path / "run"
    with pytest.raises(Preempted):
        train(compose_run_config(overrides), run_dir, overrides, callbacks=[SigtermAfterStep(5)])
    results = train(compose_run_config(overrides), run_dir, overrides)  # continues from last.ckpt

    first, second = offline_runs(run_dir / "wandb")
    stored = (run_dir / RUN_ID_FILE).read_text()
    assert first.run_id == second.run_id == stored.strip() != "surrounding" and stored.endswith("\n")
    assert (first.exit_code, second.exit_code) == (1, 0)  # the stopped part counts as failed
    for part in (first, second):  # W&B's step is the trainer's, in every row: training, validation, media
        assert part.steps == [row["trainer/global_step"] for row in part.history]
        assert part.steps == sorted(set(part.steps))
    # part 1 logged steps 1 and 3 and stopped at 5; part 2 logs Lightning's step 5 (optimizer step 6) on
    assert first.steps[-1] < second.steps[0] <= first.steps[-1] + LOG_EVERY
    assert second.steps[-1] == results["steps"] == 12  # the evaluations after training, at the final step
    assert [row["_step"] for row in second.rows_with("val/samples/path")] == [5, 11]


@pytest.mark.parametrize(
    "content",
    [b"", b"a/b", b"../../etc", b"x" * 65, b"two words", b"abc\ndef", b"\xff\xfe", b"id?x=1"],
    ids=["empty", "slash", "parent", "too long", "space", "two lines", "not text", "query"],
)
def test_a_stored_run_id_that_is_not_an_id_is_refused_in_one_line(
    content: bytes, tmp_path: Path, wandb_offline: None
) -> None:
    path = tmp_path / RUN_ID_FILE
    path.parent.mkdir()
    path.write_bytes(content)
    with pytest.raises(DataError) as refused:
        WandbRunLogger(save_dir=str(tmp_path))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    assert "is not a W&B run id" in message and "or delete it to log to a new W&B run" in message


def test_aiayn_train_refuses_a_bad_stored_run_id_before_training(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, wandb_offline: None, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:  # fmt: skip
    run_dir = tmp_path / "run"
    (run_dir / RUN_ID_FILE).parent.mkdir(parents=True)
    (run_dir / RUN_ID_FILE).write_text("../../other-run\n")
    argv = [*smoke_run(corpus_root, cache_dir, "logger=wandb"), f"hydra.run.dir={run_dir}"]
    assert train_in_process(argv, monkeypatch) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"aiayn-train: error: {run_dir / RUN_ID_FILE}: '../../other-run' is not a W&B run id")
    assert not (run_dir / "checkpoints").exists()


def test_new_run_folders_get_new_ids_which_survive_the_fall_back_to_offline(
    tmp_path: Path, wandb_offline: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("WANDB_RUN_ID", "surrounding")
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)  # "logged in" ...
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # ... to a server that is not there

    def part(folder: Path, step: int) -> str:
        logger = WandbRunLogger(save_dir=str(folder), init_timeout=2)
        assert logger.mode == "online"
        logger.log_metrics({"train/loss": 1.5}, step=step)
        logger.finish(failed=False)  # the online start failed: offline, with the folder's id
        return logger.run_id

    ids = [part(tmp_path / "a", 3), part(tmp_path / "b", 3)]
    assert ids[0] != ids[1] and "surrounding" not in ids
    assert [(tmp_path / name / RUN_ID_FILE).read_text() for name in "ab"] == [f"{ids[0]}\n", f"{ids[1]}\n"]
    assert part(tmp_path / "a", 7) == ids[0]  # a second part of a, which says that the first is not uploaded
    assert f"1 offline parts of W&B run {ids[0]} are not uploaded yet" in caplog.text
    assert [(run.run_id, run.steps) for run in offline_runs(tmp_path / "a")] == [(ids[0], [3]), (ids[0], [7])]
    assert [(run.run_id, run.steps) for run in offline_runs(tmp_path / "b")] == [(ids[1], [3])]


def test_under_a_sweep_agent_a_new_folder_takes_the_trials_id_and_a_stored_one_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweep1")  # what `wandb agent` sets for its trial
    monkeypatch.setenv("WANDB_RUN_ID", "trial123")
    assert folder_run_id(tmp_path / "new") == "trial123"
    (tmp_path / "old" / RUN_ID_FILE).parent.mkdir(parents=True)
    (tmp_path / "old" / RUN_ID_FILE).write_text("first99\n")
    assert folder_run_id(tmp_path / "old") == "first99"
    monkeypatch.setenv("WANDB_RUN_ID", "../trial")
    with pytest.raises(ConfigError, match=r"^WANDB_RUN_ID=\.\./trial is not a W&B run id"):
        folder_run_id(tmp_path / "new")


def test_steps_an_online_w_b_run_holds_already_are_not_logged_again(tmp_path: Path, wandb_offline: None) -> None:
    logged: list[tuple[dict, int]] = []
    logger = WandbRunLogger(save_dir=str(tmp_path))
    # an online part whose W&B run holds steps 0-6 from an earlier part that logged past its checkpoint
    logger._experiment = SimpleNamespace(
        id=logger.run_id, starting_step=7, log=lambda data, step: logged.append((data, step))
    )
    for step in (5, 6, 7):
        logger.log_metrics({"train/loss": 1.0}, step=step)
    assert logged == [({"train/loss": 1.0, "trainer/global_step": 7}, 7)]
