"""W&B sweep files: they parse with W&B's own schema, pass their parameters to Hydra through
${args_no_hyphens}, every trial composes; aiayn-sweep runs them locally, resumably, past failures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from aiayn.cli import report as report_cli
from aiayn.config.compose import compose_run_config
from aiayn.config.naming import run_dir
from aiayn.experiments.sweeps.file import (
    ARGS_MACRO,
    command_overrides,
    expand,
    load_sweep,
    trial_command,
    with_overrides,
)
from aiayn.experiments.sweeps.runner import exclusive
from aiayn.experiments.sweeps.state import SweepError, SweepState, Trial
from aiayn.experiments.sweeps.trial import trial_folder
from aiayn.experiments.table3 import ROWS
from helpers.runs import REPO
from helpers.sweeps import GRID, seeded, sweep_file, sweep_main
from helpers.wandb_records import offline_runs

CONF = REPO / "conf"
SWEEP_FILES = sorted((REPO / "sweeps").glob("*.yaml"))


def test_every_ablation_has_a_multi30k_and_a_paper_scale_sweep() -> None:
    names = {path.stem for path in SWEEP_FILES}
    for ablation in ("heads", "dk", "positional", "size", "regularization"):
        assert {f"{ablation}_mini", f"{ablation}_wmt14"} <= names
    covered, rows2025 = set(), {}
    for path in SWEEP_FILES:
        experiments = load_sweep(path)["parameters"].get("experiment", {}).get("values", [])
        covered |= {value.split("/")[1] for value in experiments if value.split("/")[0] in ("mini", "table3")}
        for value in experiments:
            family, row = value.split("/")
            if family.endswith("2025"):
                rows2025.setdefault(family, set()).add(row)
    assert covered == set(ROWS) - {"E"}  # E: the positional sweeps (learned)
    # Table 3 for 2025: every row at both scales, each row an experiment of both
    rows = {path.stem for path in (CONF / "experiment" / "mini2025").glob("*.yaml")}
    assert rows2025 == {"mini2025": rows, "table2025": rows}
    assert rows == {path.stem for path in (CONF / "experiment" / "table2025").glob("*.yaml")}


@pytest.mark.slow
@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: p.stem)
def test_sweep_file_parses_and_every_setting_composes(path: Path) -> None:
    """Every trial's command ends with its parameters as overrides; each setting (the trials that differ
    only in their seed) composes, and the seed override reaches the config (checked on one trial each)."""
    config = load_sweep(path)  # W&B's own schema
    assert ARGS_MACRO in config["command"] and config["metric"]["name"] == "val/bleu"
    assert len(config["parameters"]["seed"]["values"]) >= 2  # several seeds
    trials = expand(config, 1000)
    sizes = [len(spec["values"]) for spec in config["parameters"].values()]
    assert len(trials) == math.prod(sizes)  # a grid: every combination once
    assert len({json.dumps(t, sort_keys=True) for t in trials}) == len(trials)
    family = "mini" if path.stem.endswith("_mini") else "table3"
    if path.stem.startswith("table2025"):
        family = "mini2025" if family == "mini" else "table2025"
    settings = {}
    for params in trials:
        command = trial_command(config, params)
        assert command[:2] == ["/usr/bin/env", "aiayn-train"]
        assert command[-len(params) :] == [f"{key}={value}" for key, value in params.items()]
        setting = json.dumps({key: value for key, value in params.items() if key != "seed"}, sort_keys=True)
        settings.setdefault(setting, (params, command))
    assert len(settings) == len(trials) // len(config["parameters"]["seed"]["values"])
    for params, command in settings.values():
        cfg = compose_run_config(command_overrides(command))  # resolved, as the trial's job sees it
        assert cfg.name.startswith(f"{family}_") and cfg.seed == params["seed"]
        assert all(OmegaConf.select(cfg, key) == value for key, value in params.items() if key != "experiment")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("method: grid\nparameters: {seed: {values: [1]}}\ncommand: [aiayn-train]\n", "add \\$\\{args_no_hyphens\\}"),
        ("method: sideways\nparameters: {seed: {values: [1]}}\ncommand: ['${args_no_hyphens}']\n", "not a valid W&B"),
        (
            "method: grid\nparameters: {data.root: {values: [null]}}\ncommand: ['${args_no_hyphens}']\n",
            'parameters.data.root has a YAML null; W&B passes it as "None": write "null"',
        ),
        ("method: grid\nparameters: {seed: {values: [1]}}\ncommand: [a, ${args_no_hyphens}]\n", "line 3, column"),
        (
            "method: grid\nparameters: {optim: {parameters: {warmup: {values: [1]}}}}\n"
            "command: ['${args_no_hyphens}']\n",
            'parameters.optim is nested; Hydra takes no dict: use dotted keys \\("optim.x:"\\)',
        ),
        (
            "method: grid\nparameters: {tags: {values: ['a,b']}}\ncommand: ['${args_no_hyphens}']\n",
            "parameters.tags: 'a,b' reads as a Hydra sweep; quote it",
        ),
        (
            "method: grid\nparameters: {seed: {values: [1]}}\ncommand: ['${program}', '${args_no_hyphens}']\n",
            "set program:",
        ),
        ("method: bayes\nparameters: {seed: {values: [1]}}\ncommand: ['${args_no_hyphens}']\n", 'requires "metric"'),
        (
            "method: grid\nprogram: aiayn-train\nparameters: {seed: {values: [1]}}\n"
            "command: ['${interpreter}', '${program}', '${args_no_hyphens}']\n",
            "drop it for a console script",
        ),
        (
            "method: bayes\nmetric: {name: val_bleu, goal: maximize}\nparameters: {seed: {values: [1]}}\n"
            "command: ['${args_no_hyphens}']\n",
            "metric.name 'val_bleu' is not a key the trials log to their history, .*did you mean val/bleu",
        ),
        (
            "method: grid\nmetric: {name: val/blue}\nparameters: {seed: {values: [1]}}\n"
            "command: ['${args_no_hyphens}']\n",
            "metric.name 'val/blue' is not a key .*one of val/loss",
        ),
        ("method: random\nparameters: {seed: {values: [1]}}\ncommand: ['${args_no_hyphens}']\n", None),
    ],
)
def test_bad_sweep_files_are_refused_with_the_fix(
    text: str, message: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = sweep_file(tmp_path / "bad.yaml", text)
    if message is None:  # a random sweep needs a count: aiayn-sweep says so before running anything
        monkeypatch.chdir(tmp_path)
        status, out, err = sweep_main([path], capsys)
        assert status == 2 and out == ""
        assert err == f"aiayn-sweep: error: {path}: a random sweep never ends; pass --count N or set run_cap: N\n"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]  # refused before anything was written
        return
    with pytest.raises(SweepError, match=message):
        load_sweep(path)


def test_overrides_end_every_trials_command_and_cannot_undo_the_sweep() -> None:
    config = with_overrides(load_sweep(REPO / "sweeps" / "heads_wmt14.yaml"), ["hardware=slurm", "trainer.num_nodes=1"])
    command = trial_command(config, expand(config, 1)[0])
    assert command[-2:] == ["hardware=slurm", "trainer.num_nodes=1"]  # after the file's hardware=gpu8_ddp: they win
    for override, message in (
        ("seed=3", "seed is one of the sweep's parameters"),
        ("a=1,2", "is a Hydra sweep"),
        ("a=[1", r"^'a=\[1' is not a Hydra override \(\S"),  # Hydra's reason, in one line
    ):
        with pytest.raises(SweepError, match=message) as refused:
            with_overrides(config, [override])
        assert "\n" not in str(refused.value)


def test_run_cap_bounds_a_random_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = "method: random\nrun_cap: 3\nparameters: {seed: {min: 1, max: 1000}}\n"
    text += "command: [aiayn-train, '${args_no_hyphens}']\n"
    monkeypatch.chdir(tmp_path)
    with seeded():
        status, out, err = sweep_main([sweep_file(tmp_path / "s.yaml", text), "--dry-run"], capsys)
    assert status == 0 and out.count("trial ") == 3 and err == "", err


def test_random_and_bayes_draw_distinct_values_within_the_space_as_plain_numbers() -> None:
    space = {"optim.lr_scale": {"min": 0.5, "max": 2.0}, "model.n_heads": {"values": [1, 2, 4]}}
    for method in ("random", "bayes"):
        config = {"method": method, "metric": {"name": "val/bleu", "goal": "maximize"}, "parameters": space}
        with seeded():
            trials = expand(config, 5)
        assert len(trials) == 5 and len({t["optim.lr_scale"] for t in trials}) == 5
        assert all(0.5 <= t["optim.lr_scale"] <= 2.0 and t["model.n_heads"] in (1, 2, 4) for t in trials)
        assert all(type(t["optim.lr_scale"]) is float for t in trials)  # plain numbers in commands and JSON


def test_trial_folders_are_named_after_the_swept_parameters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = ["experiment=mini/base", "data.root=/data", "model.positional=none", "+x=1", "seed=2"]
    monkeypatch.chdir(tmp_path)
    assert (
        run_dir("outputs", "mini_base", None, overrides, "2026-11-30_10-00-00")
        == "outputs/mini_base/2026-11-30_10-00-00"
    )
    assert (
        run_dir("outputs", "mini_base", "sw", overrides, "t")
        == "sw/experiment=mini_base,model.positional=none,+x=1,seed=2"
    )
    params = tmp_path / "config-abc.yaml"  # what `wandb agent` writes for a trial
    params.write_text(yaml.safe_dump({"model.positional": {"value": "none"}, "+x": {"value": 1}, "seed": {"value": 2}}))
    monkeypatch.setenv("WANDB_SWEEP_PARAM_PATH", str(params))
    monkeypatch.setenv("WANDB_RUN_ID", "ab12cd")  # random and bayes may propose a setting twice
    assert run_dir("outputs", "mini_base", "sw", overrides, "t") == "sw/model.positional=none,+x=1,seed=2-ab12cd"
    monkeypatch.setenv("AIAYN_RUN_DIR", "/sweeps/s/seed=2")  # aiayn-sweep's choice wins
    assert run_dir("outputs", "mini_base", "sw", overrides, "t") == "/sweeps/s/seed=2"


def test_a_setting_proposed_twice_gets_a_second_folder(tmp_path: Path) -> None:
    config = load_sweep(sweep_file(tmp_path / "s.yaml", GRID.replace("grid", "random")))
    state = SweepState(tmp_path, config, [Trial(1, {"seed": 1}, run_dir="seed=1"), Trial(2, {"seed": 1})])
    assert trial_folder(state.trials[1], state) == "seed=1-trial-0002"  # relative: the sweep's folder may move
    assert trial_folder(state.trials[0], state) == "seed=1"  # run again: its own folder


TINY_SWEEP = """\
name: tiny
method: grid
metric: {{name: val/bleu, goal: maximize}}
parameters:
  model.positional: {{values: [sinusoidal, broken, none]}}
command:
  - ${{env}}
  - ${{interpreter}}
  - -m
  - aiayn.cli.train
  - model=tiny
  - data.root={root}
  - data.cache_dir={cache}
  - data.vocab_size=500
  - data.train_limit=200
  - data.eval_limit=16
  - trainer.max_steps=3
  - trainer.val_check_interval=3
  - trainer.check_val_every_n_epoch=null
  - progress=quiet
  - ${{args_no_hyphens}}
"""


@pytest.mark.slow
def test_aiayn_sweep_runs_skips_and_survives_a_failing_trial(
    tmp_path: Path,
    multi30k_root: Path,
    cache_dir: Path,
    wandb_offline: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The runner in this process (its trials are processes of their own)."""
    monkeypatch.chdir(tmp_path)
    sweep = sweep_file(tmp_path / "tiny.yaml", TINY_SWEEP.format(root=multi30k_root, cache=cache_dir))
    status, out, err = sweep_main([sweep, "--parallel", "2"], capsys)  # two at a time: the test takes less
    assert status == 1, err  # one trial failed: said in the exit status ...
    assert "2 of 3 trials finished" in out and "trial-0002 (exit code 2" in err
    folder = tmp_path / "outputs" / "sweeps" / "tiny"
    state = json.loads((folder / "sweep.json").read_text())
    assert [t["state"] for t in state["trials"]] == ["finished", "failed", "finished"]  # ... and the rest ran
    assert "model.positional=broken must be one of" in (folder / "logs" / "trial-0002.log").read_text()
    finished = {
        folder / t["run_dir"]: (folder / t["run_dir"] / "results.json").stat().st_mtime_ns for t in state["trials"][::2]
    }
    assert sorted(Path(d).name for d in finished) == ["model.positional=none", "model.positional=sinusoidal"]
    for trial in state["trials"][::2]:
        results = json.loads((folder / trial["run_dir"] / "results.json").read_text())
        assert results["steps"] == 3 and trial["metric"] == results["val_bleu"]
        (wandb_run,) = offline_runs(folder / trial["run_dir"])  # W&B offline, grouped by the sweep
        assert (
            wandb_run.group == "sweep/tiny"
            and wandb_run.config["model.positional"] == trial["params"]["model.positional"]
        )
        # Every sweep file's metric is a key of a real trial's history, as W&B's search reads it; its last
        # value is the trial's metric.
        history_keys = {key for row in wandb_run.history for key in row}
        for path in SWEEP_FILES:
            metric = load_sweep(path)["metric"]["name"]
            assert metric in history_keys, f"{path.name}: metric.name {metric} is not in {sorted(history_keys)}"
        assert wandb_run.rows_with("val/bleu")[-1]["val/bleu"] == pytest.approx(trial["metric"])

    status, out, _ = sweep_main([sweep], capsys)  # finished trials are skipped; the failed one runs again
    assert status == 1
    ran = [line for line in out.splitlines() if line.startswith("trial-")]
    assert len(ran) == 1 and ran[0].startswith("trial-0002 failed")
    assert {d: Path(d, "results.json").stat().st_mtime_ns for d in finished} == finished
    assert len(json.loads((folder / "sweep.json").read_text())["trials"]) == 3

    report_cli.main([str(folder), "--wandb", "disabled"])
    report = capsys.readouterr().out
    assert "| model.positional=sinusoidal |" in report and "1 unfinished trial(s) trial-0002" in report
    assert (folder / "report.md").is_file() and (folder / "bleu_ppl_vs_positional.png").stat().st_size > 1000


def test_one_runner_per_sweep_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = sweep_file(tmp_path / "s.yaml")
    folder = tmp_path / "outputs" / "sweeps" / "s"
    folder.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with exclusive(folder):  # as a runner does while it runs (flock: a second open, here too, cannot take it)
        status, _, err = sweep_main([sweep], capsys)
    assert status == 2
    assert err == f"aiayn-sweep: error: another aiayn-sweep is running in {folder}; wait for it or stop it\n"
    assert sorted(p.name for p in folder.iterdir()) == [".lock"]  # no trial started, no state written


def test_a_folder_of_another_sweep_is_not_mixed_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "sweep"
    folder.mkdir()
    trial = {"number": 1, "params": {"seed": 1}, "state": "finished"}
    (folder / "sweep.json").write_text(json.dumps({"config": {"method": "grid"}, "trials": [trial]}))
    sweep = sweep_file(tmp_path / "s.yaml")
    monkeypatch.chdir(tmp_path)
    status, _, err = sweep_main([sweep, "--dir", folder], capsys)
    assert status == 2 and err == (
        f"aiayn-sweep: error: {folder} holds a sweep of another config than {sweep}; pass --dir <another folder> "
        "or move the old one away\n"
    )


def test_dry_run_lists_every_trial_and_fails_on_one_that_does_not_compose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = sweep_file(
        tmp_path / "s.yaml",
        "method: grid\nparameters:\n  model: {values: [tiny, nonexistent]}\n  seed: {values: [1, 2]}\n"
        "command: [aiayn-train, '${args_no_hyphens}']\n",
    )
    monkeypatch.chdir(tmp_path)
    status, out, err = sweep_main([sweep, "--dry-run"], capsys)
    assert status == 2
    assert out.count("trial ") == 4 and "aiayn-train model=tiny seed=2" in out
    failures = err.splitlines()
    assert len(failures) == 2 and all(line.startswith("  does not compose: ") for line in failures)
    assert "nonexistent" in failures[0]  # Hydra's reason, in one line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]  # nothing trained, nothing written
