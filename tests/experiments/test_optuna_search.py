"""A real search by Hydra's Optuna sweeper (``aiayn-train -m hparams_search=mini_optuna``): each trial is a
run whose best monitored score the task returns; a trial that fails ends in its one line and the search
goes on. A database storage (``hydra.sweeper.storage``) keeps the study for the next command to continue."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from helpers.extras import dev_extra
from helpers.runs import SMOKE_RUN_EXTRA, smoke_run, train_in_process

pytestmark = pytest.mark.slow


def test_an_optuna_search_optimises_the_runs_best_score_and_goes_on_after_a_failed_trial(
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    dev_extra("hydra_plugins.hydra_optuna_sweeper")
    monkeypatch.chdir(tmp_path)
    argv = [
        "-m",
        "hparams_search=mini_optuna",
        *smoke_run(corpus_root, cache_dir, *SMOKE_RUN_EXTRA),
        "hydra.sweeper.n_trials=2",
        # minimised (the search follows checkpoint.mode): a smoke run's BLEU is 0, its loss is not
        "checkpoint.monitor=val/loss",
        "checkpoint.mode=min",
        # rotary positions need an even d_k: the trial that draws rope fails, the other trains (TPE, seed 2)
        "model.d_k=15",
        "hydra.sweeper.params={model.positional:'choice(rope,sinusoidal)'}",
        "seed=2",
    ]
    assert train_in_process(argv, monkeypatch) == 0

    (multirun,) = (tmp_path / "outputs" / "multirun").iterdir()
    trials = {
        job.name: yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        for job in sorted(multirun.iterdir())
        if job.is_dir()
    }
    assert sorted(trials) == ["0", "1"]
    positional = {
        name: next(o.split("=")[1] for o in overrides if o.startswith("model.positional="))
        for name, overrides in trials.items()
    }
    assert sorted(positional.values()) == ["rope", "sinusoidal"]
    failed = next(name for name, value in positional.items() if value == "rope")
    trained = next(name for name, value in positional.items() if value == "sinusoidal")
    assert not (multirun / failed / "results.json").exists()
    assert "aiayn-train: error: model.d_k=15 must be even for model.positional=rope" in capsys.readouterr().err

    results = json.loads((multirun / trained / "results.json").read_text())
    # the best checkpoint by val/loss is the one the run evaluated: its validation loss is the trial's value
    assert math.isfinite(results["best_score"]) and results["best_score"] == pytest.approx(results["val_loss"])
    best = yaml.safe_load((multirun / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(results["best_score"])
    assert best["best_params"]["model.positional"] == "sinusoidal"


def test_a_search_with_a_database_storage_continues_its_study_across_runs(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev_extra("hydra_plugins.hydra_optuna_sweeper")
    import optuna

    monkeypatch.chdir(tmp_path)
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"  # what mini_optuna.yaml recommends, in tmp_path

    def search(n_trials: int) -> None:
        argv = [
            "-m",
            "hparams_search=mini_optuna",
            *smoke_run(corpus_root, cache_dir, *SMOKE_RUN_EXTRA),
            f"hydra.sweeper.storage={storage}",
            f"hydra.sweeper.n_trials={n_trials}",
            "checkpoint.monitor=val/loss",
            "checkpoint.mode=min",
            "hydra.sweeper.params={model.positional:'choice(learned,sinusoidal)'}",
            "seed=2",
        ]
        assert train_in_process(argv, monkeypatch) == 0

    search(2)
    first = optuna.load_study(study_name="mini_table3", storage=storage).trials
    assert [trial.number for trial in first] == [0, 1]
    search(1)  # n_trials: the trials this command adds to the stored study
    study = optuna.load_study(study_name="mini_table3", storage=storage)
    assert [trial.number for trial in study.trials] == [0, 1, 2]
    assert [trial.params for trial in study.trials[:2]] == [trial.params for trial in first]
    assert all(trial.state == optuna.trial.TrialState.COMPLETE for trial in study.trials)
    # the second command ran its trials in a multirun folder of its own; the study holds all three
    assert len(list((tmp_path / "outputs" / "multirun").iterdir())) == 2


@pytest.mark.parametrize(
    ("storage", "why"),
    [
        ("postgresql://localhost/optuna", "Failed to import DB access module"),
        ("sqlite:///{tmp}/file/optuna.db", "unable to open database file"),
    ],
)
def test_a_study_storage_that_cannot_be_opened_is_refused_in_one_line_before_any_trial(
    storage: str, why: str, tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:  # fmt: skip
    dev_extra("hydra_plugins.hydra_optuna_sweeper")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("a file, not a folder")
    url = storage.format(tmp=tmp_path)
    argv = ["-m", "hparams_search=mini_optuna", *smoke_run(corpus_root, cache_dir), f"hydra.sweeper.storage={url}"]
    assert train_in_process(argv, monkeypatch) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"aiayn-train: error: hydra.sweeper.storage={url} cannot be opened (") and why in line
    assert not (tmp_path / "outputs" / "multirun").exists() or not any(
        (tmp_path / "outputs" / "multirun").rglob("*.yaml")
    )
