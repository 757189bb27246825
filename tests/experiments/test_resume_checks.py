"""A resume continues the training its checkpoint holds, or it is refused before any work: other data,
another tokenizer, another batching or seed end with exit 2 and both values; a changed schedule is
applied and recorded; a multirun's job continues only its own overrides; an abandoned continuation's
checkpoints are set aside; ``resume=false`` never continues a run."""

from __future__ import annotations

import csv
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from aiayn.training.checkpoints import BATCH_KEY, RUN_KEY
from aiayn.training.metrics import drop_metrics_from
from aiayn.training.schedule import NoamSchedule, WarmupDecaySchedule
from helpers.runs import SMOKE_RUN_EXTRA, copy_of, smoke_run, train_in_process


def continued(root: Path, cache: Path, *extra: str) -> list[str]:
    """The overrides of the smoke run, which a resume of it continues, plus ``extra``."""
    return smoke_run(root, cache, *SMOKE_RUN_EXTRA, *extra)


def last_error(capsys: pytest.CaptureFixture) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("data.vocab_size=900", "data.vocab_size=1000, this run has data.vocab_size=900"),
        ("data.max_tokens=700", "data.max_tokens=800, this run has data.max_tokens=700"),
        ("tokens_per_step=1600", "tokens_per_step=null, this run has tokens_per_step=1600"),
        ("seed=5", "seed=1, this run has seed=5"),
        ("model.d_ff=64", "model.d_ff=128, this run has model.d_ff=64"),
    ],
)
def test_a_resume_that_cannot_honour_a_setting_is_refused_naming_both_values(
    smoke_run_dir: Path,
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    change: str,
    named: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    last = smoke_run_dir / "checkpoints" / "last.ckpt"
    argv = [*continued(corpus_root, cache_dir, change, "trainer.max_steps=18"), f"hydra.run.dir={tmp_path / 'new'}"]
    assert train_in_process([*argv, f"resume={last}"], monkeypatch) == 2
    error = last_error(capsys)
    assert error.startswith(f"aiayn-train: error: checkpoint {last} was trained with {named}"), error
    assert not (tmp_path / "new" / "checkpoints").exists()


def test_a_resume_on_a_changed_corpus_is_refused(
    smoke_run_dir: Path,
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(corpus_root, corpus)
    lines = (corpus / "train.de").read_text().splitlines(keepends=True)
    (corpus / "train.de").write_text("".join(["ein anderer Satz\n", *lines[1:]]))
    last = smoke_run_dir / "checkpoints" / "last.ckpt"
    argv = [*continued(corpus, cache_dir, "trainer.max_steps=18"), f"hydra.run.dir={tmp_path / 'new'}"]
    assert train_in_process([*argv, f"resume={last}"], monkeypatch) == 2
    error = last_error(capsys)
    assert "was trained on the data of cache entry" in error and "a resumed run cannot change its data" in error


def test_a_resumed_run_trains_with_the_new_schedule_and_records_it(
    smoke_run_dir: Path,
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    run_dir = copy_of(smoke_run_dir, tmp_path)
    peak = yaml.safe_load((run_dir / "config.yaml").read_text())["optim"]["lr"]
    changed = ("optim.schedule=noam", "optim.lr=null", "optim.warmup=3", "optim.lr_scale=2.0", "trainer.max_steps=18")
    argv = [*continued(corpus_root, cache_dir, *changed)]
    with caplog.at_level(logging.WARNING):
        assert train_in_process([*argv, f"hydra.run.dir={run_dir}", "resume=true"], monkeypatch) == 0
    assert "optim.warmup=10 → 3" in caplog.text and "optim.lr_scale=1.0 → 2.0" in caplog.text
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["optim"]["warmup"] == 3 and config["optim"]["lr_scale"] == 2.0
    with open(run_dir / "csv" / "metrics.csv", newline="") as rows:
        logged = {int(row["step"]): float(row["train/lr"]) for row in csv.DictReader(rows) if row.get("train/lr")}
    # The smoke run's: the default linear decay, from its peak after its 10 warmup steps to 0 at its 12th.
    new, old = NoamSchedule(config["model"]["d_model"], 3, 2.0), WarmupDecaySchedule("linear", peak, 10)
    old.place_decay(10, 12)
    resumed = {step: lr for step, lr in logged.items() if step > 12}
    assert resumed and all(lr == pytest.approx(new(step)) for step, lr in resumed.items()), resumed
    before = {step: lr for step, lr in logged.items() if step <= 12}
    assert before and all(lr == pytest.approx(old(step)) for step, lr in before.items()), before
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert state["lr_schedulers"][0]["lr_lambdas"][0]["warmup"] == 3


@pytest.mark.slow
def test_a_multirun_job_continues_only_its_own_overrides(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    sweep = ["-m", f"hydra.sweep.dir={tmp_path / 'multirun'}", *continued(corpus_root, cache_dir)]
    assert train_in_process([*sweep, "optim.warmup=8"], monkeypatch) == 0
    job = tmp_path / "multirun" / "0"
    before = (job / "checkpoints" / "last.ckpt").read_bytes()
    capsys.readouterr()
    assert train_in_process([*sweep, "optim.warmup=9"], monkeypatch) == 2  # job 0 again, with another value
    error = last_error(capsys)
    assert f"{job} holds the run of optim.warmup=8, this one is of optim.warmup=9" in error, error
    assert (job / "checkpoints" / "last.ckpt").read_bytes() == before
    assert train_in_process([*sweep, "optim.warmup=8"], monkeypatch) == 0  # the same job continues (nothing left)


def test_resuming_an_older_step_sets_the_newer_checkpoints_aside(
    smoke_run_dir: Path, tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = copy_of(smoke_run_dir, tmp_path)
    step6 = run_dir / "checkpoints" / "step0000006.ckpt"
    abandoned = (run_dir / "checkpoints" / "step0000012.ckpt").read_bytes()
    argv = [*continued(corpus_root, cache_dir), f"hydra.run.dir={run_dir}", f"resume={step6}"]
    assert train_in_process(argv, monkeypatch) == 0
    aside = run_dir / "checkpoints" / "abandoned-after-step6"
    assert {"step0000012.ckpt", "last.ckpt"} <= {path.name for path in aside.iterdir()}
    assert (aside / "step0000012.ckpt").read_bytes() == abandoned
    assert torch.load(run_dir / "checkpoints" / "step0000012.ckpt", weights_only=True)["global_step"] == 12


def test_resume_false_never_continues_a_run(
    smoke_run_dir: Path,
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    run_dir = copy_of(smoke_run_dir, tmp_path)
    before = (run_dir / "checkpoints" / "last.ckpt").read_bytes()
    argv = [*continued(corpus_root, cache_dir), f"hydra.run.dir={run_dir}", "resume=false"]
    assert train_in_process(argv, monkeypatch) == 2
    assert last_error(capsys).startswith(f"aiayn-train: error: resume=false but {run_dir} holds a run")
    assert (run_dir / "checkpoints" / "last.ckpt").read_bytes() == before


def test_a_resume_on_other_processes_or_accumulation_is_refused(
    smoke_run_dir: Path,
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """``trainer.devices=auto`` is one setting on machines of 2 and of 8 GPUs: the layout is compared."""
    checkpoint = torch.load(smoke_run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint[RUN_KEY][BATCH_KEY] == {"world_size": 1, "accumulation": 1}
    checkpoint[RUN_KEY][BATCH_KEY]["world_size"] = 2  # as written by a run of two processes
    moved = tmp_path / "two-processes.ckpt"
    torch.save(checkpoint, moved)
    argv = [*continued(corpus_root, cache_dir, "trainer.max_steps=18"), f"hydra.run.dir={tmp_path / 'new'}"]
    assert train_in_process([*argv, f"resume={moved}"], monkeypatch) == 2
    assert "was trained with world_size=2 (training processes), this run has world_size=1" in last_error(capsys)


def test_metric_rows_after_the_resumed_step_are_dropped_cut_rows_too(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("epoch,step,train/loss\n0,1,5.0\n0,5,4.0\n0,6,3.0\n0,7,2.0\n0,8")  # the last row cut short
    assert drop_metrics_from(metrics, 6) == 3
    assert metrics.read_text() == "epoch,step,train/loss\n0,1,5.0\n0,5,4.0\n"
