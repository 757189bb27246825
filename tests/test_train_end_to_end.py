"""Real `aiayn-train` runs in a subprocess: Hydra, Lightning, sentencepiece and sacreBLEU together."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest
import torch

from aiayn.schedule import NoamSchedule

pytestmark = pytest.mark.slow


def run_train(run_dir: Path, multi30k_root: Path, cache_dir: Path, *overrides: str) -> dict:
    command = [
        "aiayn-train",
        f"data.root={multi30k_root}",
        f"data.cache_dir={cache_dir}",
        f"hydra.run.dir={run_dir}",
        "trainer.enable_progress_bar=false",
        *overrides,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((run_dir / "results.json").read_text())


def metric_rows(run_dir: Path, key: str) -> list[tuple[int, float]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return [(int(row["step"]), float(row[key])) for row in csv.DictReader(f) if row.get(key)]


def test_training_on_a_slice_of_multi30k_writes_results_and_learns(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    results = run_train(
        run_dir, multi30k_root, cache_dir,
        "model=tiny", "data.vocab_size=1000", "data.train_limit=3000", "data.eval_limit=100",
        "data.max_tokens=1500", "trainer.max_steps=120", "trainer.val_check_interval=40",
        "trainer.check_val_every_n_epoch=null", "trainer.accumulate_grad_batches=2",
        "trainer.log_every_n_steps=10", "optim.warmup=40",
    )  # fmt: skip
    for key in ("params", "val_bleu", "test_bleu", "sacrebleu_signature", "val_ppl", "steps",
                "train_tokens_per_s", "wall_s", "overrides"):  # fmt: skip
        assert key in results, key
    assert results["steps"] == 120 and results["train_tokens_per_s"] > 0
    assert "tok:13a" in results["sacrebleu_signature"] and "case:mixed" in results["sacrebleu_signature"]
    assert "model=tiny" in results["overrides"]
    assert (run_dir / "config.yaml").is_file()
    assert {p.name for p in (run_dir / "checkpoints").iterdir()} == {"best.ckpt", "last.ckpt"}
    assert len((run_dir / "test.hyp.txt").read_text().splitlines()) == 100

    val_loss = metric_rows(run_dir, "val/loss")
    # every 40 batches (20 optimizer steps) over 240 batches, then once more for the best checkpoint
    assert len(val_loss) == 7
    assert val_loss[5][1] < val_loss[0][1] - 0.5
    val_bleu = [bleu for _, bleu in metric_rows(run_dir, "val/bleu")[:6]]
    assert results["val_bleu"] == pytest.approx(max(val_bleu), abs=1e-4)  # best.ckpt is the best by BLEU

    # eq. 3 advanced once per optimizer step, though two batches make each step. The CSV's step column
    # counts the optimizer steps done before the logged batch: step k is scheduled at schedule(k).
    schedule = NoamSchedule(64, warmup=40)
    lrs = metric_rows(run_dir, "train/lr")
    assert len(lrs) >= 10
    for step, lr in lrs:
        assert lr == pytest.approx(schedule(step), rel=1e-4)

    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 120


def test_overfitting_64_pairs_reaches_bleu_above_90(tmp_path: Path, multi30k_root: Path, cache_dir: Path) -> None:
    results = run_train(tmp_path / "run", multi30k_root, cache_dir, "experiment=overfit")
    assert results["val_bleu"] > 90, results
