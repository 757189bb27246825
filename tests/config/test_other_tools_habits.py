"""What users of lightning-hydra-template, Lightning and fairseq type out of habit: keys aiayn does not read
are refused in one line before any work (``+seeds=3``, ``ckpt_path=``), Lightning's ``fast_dev_run`` needs
no ``+``, personal config folders join through ``hydra.searchpath`` (also in aiayn-sweep's trials), and
callbacks come from either Lightning package."""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import pytest
import yaml

from helpers.extras import dev_extra
from helpers.runs import SMOKE_RUN_EXTRA, refusal, smoke_run, train_in_process
from helpers.sweeps import sweep_main


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("+seeds=3", "seeds=3 is not a setting of aiayn; seed=<n> (several seeds: -m seed=1,2,3)"),
        ("+ckpt_path=last.ckpt", "ckpt_path=last.ckpt is not a setting of aiayn; resume=<checkpoint> continues"),
        ("ckpt_path=last.ckpt", "ckpt_path=last.ckpt is not a setting of aiayn; resume=<checkpoint> continues"),
        ("+sed=3", "sed=3 is not a setting aiayn reads (did you mean seed?"),
        ("+wandb.project=x", "wandb={'project': 'x'} is not a setting aiayn reads"),
    ],
)
def test_keys_aiayn_does_not_read_are_refused_before_any_work(
    override: str,
    says: str,
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert refusal([*smoke_run(corpus_root, cache_dir), override], monkeypatch, capsys).startswith(says)
    assert not [p for p in (tmp_path / "outputs").rglob("*") if p.is_file() and p.suffix != ".log"]


def test_inside_a_section_hydras_advice_to_add_a_key_with_plus_stays(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    assert train_in_process(["trainer.limit_val_batches=2"], monkeypatch) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("To append to your config use +trainer.limit_val_batches=2")


def test_keys_added_inside_a_section_and_lightnings_fast_dev_run_compose(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["--cfg", "job", "trainer.fast_dev_run=true", "+trainer.limit_val_batches=2"]
    assert train_in_process(argv, monkeypatch) == 0
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert trainer["fast_dev_run"] is True and trainer["limit_val_batches"] == 2


def personal_configs(folder: Path) -> Path:
    """A researcher's own config folder: a hardware option and an experiment, beside aiayn's."""
    (folder / "hardware").mkdir(parents=True)
    (folder / "experiment").mkdir()
    (folder / "hardware" / "my_box.yaml").write_text(
        "# @package _global_\n# my workstation\ntrainer: {accelerator: cpu, devices: 1}\ndata: {num_workers: 0}\n"
    )
    (folder / "experiment" / "my_row.yaml").write_text(
        "# @package _global_\n# my Table 3 row\ndefaults:\n  - /experiment/mini/base\n  - _self_\n"
        "model: {n_heads: 2, d_k: 48, d_v: 48}\n"
    )
    return folder


def test_a_personal_config_folder_joins_through_hydra_searchpath_also_in_a_sweeps_trials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    mine = personal_configs(tmp_path / "aiayn-conf")
    searchpath = f"hydra.searchpath=[file://{mine}]"
    assert train_in_process(["--cfg", "job", searchpath, "experiment=my_row", "hardware=my_box"], monkeypatch) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert (cfg["model"]["n_heads"], cfg["model"]["d_k"], cfg["model"]["n_layers"]) == (2, 48, 3)  # mine on mini/base
    assert cfg["trainer"]["devices"] == 1 and cfg["trainer"]["max_steps"] == 500

    sweep = tmp_path / "mine.yaml"
    sweep.write_text(
        "name: mine\nprogram: aiayn-train\nmethod: grid\nmetric: {name: val/bleu, goal: maximize}\n"
        "parameters:\n  experiment: {values: [my_row, mini/base]}\n"
        "command: ['${env}', '${program}', hardware=my_box, '${args_no_hyphens}']\n"
    )
    status, out, err = sweep_main([sweep, searchpath, "--dry-run"], capsys)
    assert status == 0, err
    assert out.count("hydra.searchpath=") == 2 and "experiment=my_row" in out
    status, _, err = sweep_main([sweep, "--dry-run"], capsys)  # without the folder, its options do not exist
    assert status == 2 and "my_row" in err


def test_a_callback_from_the_lightning_package_runs_in_aiayns_trainer(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev_extra("lightning.pytorch")
    run_dir = tmp_path / "run"
    monitor = "callbacks=[{_target_:lightning.pytorch.callbacks.LearningRateMonitor}]"
    argv = [*smoke_run(corpus_root, cache_dir, *SMOKE_RUN_EXTRA), f"hydra.run.dir={run_dir}", monitor]
    assert train_in_process(argv, monkeypatch) == 0
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    logged = [(int(row["step"]), float(row["lr-Adam"])) for row in rows if row.get("lr-Adam")]
    # the monitor logs Adam's rate at each logging step: eq. 3 climbs during the warmup (10 steps)
    assert len(logged) >= 5 and all(a[1] < b[1] for a, b in itertools.pairwise(logged) if b[0] <= 10)
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 12
