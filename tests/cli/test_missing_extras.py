"""A command that needs a library of an extra this install lacks ends in one line on stderr naming the
``pip install`` that brings it, with exit status 2 and no traceback (:mod:`aiayn.extras`).

The library is hidden as ``None`` in ``sys.modules`` (importing it raises, ``find_spec`` finds nothing),
in this process; Hydra's plugins in a fresh process, since Hydra reads them once per process. Each
command stops before it reads its inputs, so none are made.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from aiayn.cli import evaluate as evaluate_cli
from aiayn.cli import export as export_cli
from aiayn.cli import report as report_cli
from aiayn.cli import sweep as sweep_cli
from aiayn.config.compose import compose_run_config
from helpers.runs import REPO, exit_status, train_in_process

HYDRA_QUIET = ["hydra/job_logging=none", "hydra/hydra_logging=none"]


def hide(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make ``names`` (and their submodules already imported) look not installed, for this test."""
    for name in names:
        for loaded in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            monkeypatch.delitem(sys.modules, loaded)
        monkeypatch.setitem(sys.modules, name, None)


def one_line(status: int, err: str, program: str, what: str, extra: str) -> None:
    assert (status, err) == (2, f"{program}: error: {what} is not installed: pip install 'aiayn[{extra}]'\n")


def test_aiayn_sweep_without_the_sweep_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    hide(monkeypatch, "sweeps", "jsonschema")
    argv = [str(REPO / "sweeps" / "heads_mini.yaml"), "--dir", str(tmp_path / "sweep")]
    for extra in ([], ["--dry-run"]):
        status = exit_status(partial(sweep_cli.main, [*argv, *extra]), ["aiayn-sweep"], monkeypatch)
        one_line(status, capsys.readouterr().err, "aiayn-sweep", "W&B's sweep engine", "sweep")
    assert not (tmp_path / "sweep").exists()


def test_aiayn_sweep_on_slurm_without_submitit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    hide(monkeypatch, "submitit")
    argv = [str(REPO / "sweeps" / "heads_mini.yaml"), "--dir", str(tmp_path / "sweep"), "--launcher", "slurm"]
    status = exit_status(partial(sweep_cli.main, argv), ["aiayn-sweep"], monkeypatch)
    one_line(status, capsys.readouterr().err, "aiayn-sweep", "submitit (--launcher slurm)", "sweep")
    assert not (tmp_path / "sweep").exists()


def test_a_wmt_run_without_datasets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    hide(monkeypatch, "datasets")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "wmt14").mkdir()
    status = train_in_process(["data=wmt14_en_de", "data.root=wmt14", "logger=none"], monkeypatch)
    what = "Hugging Face's datasets library (data=wmt14_*)"
    one_line(status, capsys.readouterr().err, "aiayn-train", what, "wmt")
    assert not list(tmp_path.glob("outputs/*/*"))  # the run's folder, made by Hydra, is removed


@pytest.mark.slow
def test_aiayn_report_plots_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Two finished runs that differ in their heads: a plot to draw."""
    for heads in (2, 4):
        run = tmp_path / "runs" / f"h{heads}"
        run.mkdir(parents=True)
        overrides = ["experiment=mini/base", f"model.n_heads={heads}"]
        OmegaConf.save(compose_run_config(overrides), run / "config.yaml")
        results = {"params": 1000, "steps": 500, "val_bleu": 20.0, "val_ppl": 9.0, "overrides": overrides}
        (run / "results.json").write_text(json.dumps(results))
    hide(monkeypatch, "matplotlib")
    status = exit_status(report_cli.main, ["aiayn-report", str(tmp_path / "runs"), "--wandb", "disabled"], monkeypatch)
    one_line(status, capsys.readouterr().err, "aiayn-report", "matplotlib (aiayn-report's plots)", "report")
    assert not list((tmp_path / "runs").glob("*.png")) and not (tmp_path / "runs" / "report.md").exists()


@pytest.mark.parametrize(
    ("library", "argv", "what"),
    [
        ("transformers", ["format=hf"], "Hugging Face transformers (format=hf)"),
        ("ctranslate2", ["format=ctranslate2"], "CTranslate2 (format=ctranslate2, backend=ctranslate2)"),
    ],
    ids=["hf", "ctranslate2"],
)
def test_aiayn_export_without_its_library(
    library: str,
    argv: list[str],
    what: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    hide(monkeypatch, library)
    monkeypatch.chdir(tmp_path)
    command = ["aiayn-export", "checkpoint=model.ckpt", "output=exported", *argv, *HYDRA_QUIET]
    status = exit_status(export_cli.main, command, monkeypatch)
    one_line(status, capsys.readouterr().err, "aiayn-export", what, "export")
    assert not (tmp_path / "exported").exists()


def test_aiayn_eval_on_ctranslate2_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    hide(monkeypatch, "ctranslate2")
    monkeypatch.chdir(tmp_path)
    command = ["aiayn-eval", "checkpoint=model.ckpt", "backend=ctranslate2", *HYDRA_QUIET]
    status = exit_status(evaluate_cli.main, command, monkeypatch)
    what = "CTranslate2 (format=ctranslate2, backend=ctranslate2)"
    one_line(status, capsys.readouterr().err, "aiayn-eval", what, "export")


@pytest.mark.parametrize(
    ("library", "what"), [("transformers", "COMET's encoder (transformers)"), ("entmax", "entmax (COMET's sparsemax)")]
)
def test_aiayn_eval_with_comet_without_its_libraries(
    library: str, what: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    hide(monkeypatch, library)
    monkeypatch.chdir(tmp_path)
    command = ["aiayn-eval", "checkpoint=model.ckpt", "comet.model=Unbabel/wmt22-comet-da", *HYDRA_QUIET]
    status = exit_status(evaluate_cli.main, command, monkeypatch)
    one_line(status, capsys.readouterr().err, "aiayn-eval", what, "comet")


# Hydra's plugins hidden before Hydra looks for them: aiayn-train with each override, its exit status
# and stderr per override.
WITHOUT_PLUGINS = """
import contextlib, io, json, sys

sys.modules["hydra_plugins"] = None
from aiayn.cli.train import main

seen = {}
for overrides in json.loads(sys.argv[1]):
    sys.argv = ["aiayn-train", *overrides]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            main()
            status = 0
        except SystemExit as stop:
            status = stop.code
    seen[" ".join(overrides)] = [status, err.getvalue()]
print(json.dumps(seen))
"""


def test_hydra_plugins_of_an_extra_missing(tmp_path: Path) -> None:
    """``hardware=slurm`` (Hydra's submitit launcher) and ``hydra/sweeper=optuna``: Hydra cannot find the
    option; aiayn-train says which extra brings it."""
    runs = {
        "hardware=slurm": ("Hydra's submitit launcher (hardware=slurm)", "slurm"),
        "-m hydra/sweeper=optuna": ("Hydra's Optuna sweeper", "optuna"),
    }
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_PLUGINS, json.dumps([[*o.split(), *HYDRA_QUIET] for o in runs])],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    for overrides, (what, extra) in runs.items():
        status, err = seen[" ".join([*overrides.split(), *HYDRA_QUIET])]
        one_line(status, err, "aiayn-train", what, extra)
