"""What a multirun's job hands the DDP ranks Lightning starts (the job alone, never the sweep), and the
launchers that cannot start those ranks, refused before any work."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from aiayn.cli.multirun import JobRanks, job_command, starts_ranks, sweeper_value
from helpers.runs import smoke_run, train_in_process


def test_a_jobs_command_keeps_the_config_flags_and_hydras_own_overrides_but_not_the_sweep() -> None:
    sweep = ["hydra.mode=MULTIRUN", "hydra.sweep.dir=/s", "hydra/launcher=basic", "hydra.launcher.n_jobs=2"]
    sweep += ["hydra/sweeper=optuna", "hydra.sweeper.n_trials=3"]
    kept = ["hydra.searchpath=[file:///mine]", "hydra.job.chdir=false"]
    task = ["seed=1", "data.root='/a b'", "+trainer.fast_dev_run=true"]
    hydra_cfg = OmegaConf.create({"overrides": {"hydra": [*sweep[:2], *kept, *sweep[2:]], "task": task}})
    argv = ["aiayn-train", "-m", "--config-dir", "/conf", "-cn", "train", "seed=1,2", "hydra.sweep.dir=/s"]
    flags = ["--config-name", "train", "--config-dir", "/conf"]
    assert job_command(argv, hydra_cfg) == ["aiayn-train", *flags, *kept, *task]


@pytest.mark.parametrize(
    ("trainer", "expected"),
    [
        ({"devices": 2, "strategy": {"_target_": "pytorch_lightning.strategies.DDPStrategy"}}, True),
        ({"devices": 1, "num_nodes": 2, "strategy": "ddp"}, True),
        ({"devices": [0, 1], "strategy": "ddp_find_unused_parameters_true"}, True),
        ({"devices": 1, "strategy": {"_target_": "pytorch_lightning.strategies.DDPStrategy"}}, False),
        ({"devices": 8, "strategy": "auto"}, False),
        ({"devices": 1}, False),
    ],
)
def test_which_runs_start_ddp_ranks(trainer: dict, expected: bool) -> None:
    assert starts_ranks(OmegaConf.create(trainer)) is expected


def test_a_sweeper_gets_the_best_score_or_the_worst_value_for_a_failed_run() -> None:
    assert sweeper_value({"best_score": 31.5}, "max") == 31.5
    assert sweeper_value(None, "max") == -math.inf and sweeper_value(None, "min") == math.inf
    assert sweeper_value({"best_score": None}, "min") == math.inf
    assert sweeper_value({"best_score": math.nan}, "max") == -math.inf


def test_a_launcher_that_cannot_start_ddp_ranks_is_refused_before_any_work(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["-m", "hydra/launcher=submitit_local", "hardware=cpu_ddp", "seed=1,2", *smoke_run(corpus_root, cache_dir)]
    assert train_in_process(argv, monkeypatch) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("aiayn-train: error: hydra/launcher=submitit_local cannot start the DDP ranks of a job")
    assert "basic launcher" in line
    assert not (tmp_path / "outputs").exists()


def test_a_jobs_ranks_are_waited_for_and_killed_after_a_grace_when_the_job_failed() -> None:
    ranks = JobRanks()
    ranks.processes = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])]
    ranks.end(grace=None)
    assert ranks.processes[0].returncode == 0  # a finished job's ranks end by themselves
    ranks.processes = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])]
    ranks.end(grace=0.5)
    assert ranks.processes[0].returncode == -signal.SIGKILL  # stuck waiting for the failed rank 0
