"""docs/components.md, step by step: a user's attention class in a file of their own folder, with its
config entry there, trains (``hydra.searchpath``), is refused by aiayn-eval until trusted, evaluates once
trusted, and sweeps beside the built-in attention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import aiayn
from aiayn.cli import evaluate as evaluate_cli
from aiayn.model import components
from helpers.runs import REPO, exit_status, smoke_run
from helpers.sweeps import sweep_main

FOLDER = REPO / "tests" / "assets" / "user_components"
TARGET = "qk_norm_attention.QKNormAttention"
# W&B's schema takes no "/" in a parameter's name: a sweep chooses components through experiments.
SWEEP = """name: qk_norm
program: aiayn-train
method: grid
parameters:
  experiment:
    values: [qk_norm, mini2025/base]
  seed:
    values: [1, 2]
command:
  - ${env}
  - ${program}
  - ${args_no_hyphens}
"""


@pytest.mark.slow
def test_a_users_attention_trains_evaluates_once_trusted_and_sweeps(
    corpus_root: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.syspath_prepend(str(FOLDER))  # PYTHONPATH=<your folder>
    monkeypatch.chdir(tmp_path)
    searchpath = f"hydra.searchpath=[file://{FOLDER / 'conf'}]"
    short = ["trainer.max_steps=6", "checkpoint.average_last=0", "decoding=greedy"]
    short += ["decoding.max_len_offset=3", "val_decoding.max_len_offset=3"]
    overrides = [*smoke_run(corpus_root, cache_dir, *short), searchpath, "model/attention=qk_norm"]
    results = aiayn.train(overrides, run_dir=tmp_path / "run")
    assert results["steps"] == 6
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    stored = torch.load(checkpoint, map_location="cpu", weights_only=True)["hyper_parameters"]["model"]
    assert stored["attention"] == {"_target_": TARGET, "scale": 10.0}

    monkeypatch.delitem(components._registered, TARGET)  # another process: it never saw the run's config
    evaluate = ["aiayn-eval", f"checkpoint={checkpoint}", f"data.root={corpus_root}", "decoding=greedy", "device=cpu"]
    evaluate += ["decoding.max_len_offset=3"]
    assert exit_status(evaluate_cli.main, evaluate, monkeypatch) == 2
    refusal = capsys.readouterr().err.strip()
    assert len(refusal.splitlines()) == 1 and f"trust_components=[{TARGET}]" in refusal
    assert exit_status(evaluate_cli.main, [*evaluate, f"trust_components=[{TARGET}]"], monkeypatch) == 0
    assert "BLEU" in capsys.readouterr().out

    sweep = tmp_path / "qk_norm.yaml"
    sweep.write_text(SWEEP)
    status, out, err = sweep_main([sweep, "--dry-run", searchpath], capsys)
    assert status == 0 and err == "" and out.count("experiment=qk_norm") == 2
