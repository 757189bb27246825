"""Which checkpoint a run's numbers come from: the final step is always validated and kept as a step
checkpoint (the newest of those averaged, §6.1), and ``checkpoint.evaluate=final`` scores the final model,
as the paper's Table 3 does (table3/*), with the best validation's score kept beside it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from aiayn.config.compose import compose_run_config
from aiayn.experiments.after_training import run_answer
from aiayn.training.checkpoint_policy import CheckpointPolicy
from helpers.runs import REPO, train_in_process


def validations(run_dir: Path) -> dict[int, float]:
    """optimizer step -> val/bleu of every validation during training, from the run's metrics CSV (whose
    rows carry Lightning's step, one less)."""
    with open(run_dir / "csv" / "metrics.csv", newline="") as rows:
        logged = [(int(row["step"]) + 1, float(row["val/bleu"])) for row in csv.DictReader(rows) if row["val/bleu"]]
    return dict(logged[:-1])  # the last row is the evaluation after training


@pytest.mark.slow
def test_the_final_step_is_a_step_checkpoint_and_final_scores_the_last_model(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    argv = ["debug=smoke", f"data.root={corpus_root}", f"data.cache_dir={cache_dir}", f"hydra.run.dir={run_dir}"]
    argv += ["trainer.max_steps=11", "checkpoint.every_steps=4", "checkpoint.keep_last=3", "checkpoint.average_last=3"]
    assert train_in_process([*argv, "checkpoint.evaluate=final", "checkpoint.answer=averaged"], monkeypatch) == 0
    results = json.loads((run_dir / "results.json").read_text())
    assert results["answer"] == "averaged" and results["answer_checkpoint"] == "checkpoints/averaged.ckpt"
    assert (results["answer_test_bleu"], results["answer_test_chrf"]) == (
        results["test_bleu_averaged"], results["test_chrf_averaged"]
    )  # fmt: skip
    assert sorted(validations(run_dir)) == [4, 8, 11]  # 11 is not a multiple of 4: validated all the same
    # the averaged and EMA checkpoints are validated too, for checkpoint.answer=by_validation, unlogged
    assert 0 <= results["val_bleu_averaged"] <= 100 and 0 <= results["val_bleu_ema"] <= 100
    assert results["averaged_checkpoints"] == ["step0000004.ckpt", "step0000008.ckpt", "step0000011.ckpt"]
    assert results["evaluated"] == "final" and results["evaluated_checkpoint"] == "checkpoints/last.ckpt"
    final = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert final["global_step"] == results["steps"] == 11
    assert results["val_bleu"] == pytest.approx(validations(run_dir)[11], abs=1e-4)  # the final model's score
    assert results["best_val_bleu"] == pytest.approx(max(validations(run_dir).values()), abs=1e-4)


@pytest.mark.slow
def test_table3_rows_score_the_final_checkpoint_and_other_runs_the_best() -> None:
    rows = sorted(path.stem for path in (REPO / "conf" / "experiment" / "table3").glob("*.yaml"))
    assert "big" in rows and len(rows) == 20
    for row in rows:  # big too: it builds on paper/big_wmt14_en_de, not on table3/base
        assert compose_run_config([f"experiment=table3/{row}"]).checkpoint.evaluate == "final", row
    assert compose_run_config(["experiment=paper/base_wmt14_en_de"]).checkpoint.evaluate == "best"
    assert compose_run_config([]).checkpoint.evaluate == "best"


def test_by_validation_answers_with_the_tested_checkpoint_of_the_best_validation_bleu() -> None:
    """The test scores are reported, never read to choose: the EMA's test BLEU of 50 does not win."""
    policy = CheckpointPolicy("val/bleu", "max", 3, 3, "best", None, None, answer="by_validation")
    test = {"test_bleu": 10.0, "test_chrf": 30.0}
    averaged = {"test_bleu_averaged": 12.0, "test_chrf_averaged": 31.0, "val_bleu_averaged": 20.0}
    ema = {"test_bleu_ema": 50.0, "test_chrf_ema": 60.0, "val_bleu_ema": 19.0}
    answer = run_answer(policy, "checkpoints/best.ckpt", 18.0, test, averaged, ema)
    assert answer == {"answer": "averaged", "answer_checkpoint": "checkpoints/averaged.ckpt",
                      "answer_test_bleu": 12.0, "answer_test_chrf": 31.0}  # fmt: skip
    assert run_answer(policy, "checkpoints/best.ckpt", 21.0, test, averaged, ema)["answer"] == "best"
    assert run_answer(policy, "checkpoints/best.ckpt", 19.0, test, {}, ema)["answer"] == "best"  # a tie: evaluated
    assert (
        run_answer(policy, "checkpoints/last.ckpt", 1.0, test, {}, ema)["answer_checkpoint"] == "checkpoints/ema.ckpt"
    )
