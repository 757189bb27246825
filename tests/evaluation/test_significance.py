"""Paired bootstrap significance is sacreBLEU's own: the scoring function against sacreBLEU's PairedTest
and its command line, aiayn-eval comparing a checkpoint with a file of hypotheses and with a second
checkpoint, and aiayn-report's ``p (test)`` column on the concatenated seeds of a real run's layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sacrebleu.significance
from sacrebleu.metrics.bleu import BLEU
from sacrebleu.significance import PairedTest

from aiayn.data.corpus import read_lines
from aiayn.experiments.report.document import write_report
from aiayn.scoring import paired_bootstrap
from helpers.report_layout import copy_run, perturbed, table_rows
from helpers.runs import eval_in_process

pytestmark = pytest.mark.usefixtures("wandb_offline")


@pytest.fixture(scope="module")
def references(corpus_root: Path) -> list[str]:
    return read_lines(corpus_root / "test_2016_flickr.de")


def sacrebleu_directly(systems: list[list[str]], refs: list[str]) -> list[sacrebleu.significance.Result]:
    """sacreBLEU's paired bootstrap as its own command line calls it (default resamples and seed)."""
    named = [(f"system {i}", hyps) for i, hyps in enumerate(systems)]
    _, scores = PairedTest(named, {"BLEU": BLEU()}, [refs], test_type="bs")()
    return scores["BLEU"]


def test_the_paired_bootstrap_is_sacrebleus_and_its_difference_interval_uses_the_same_resamples(
    references: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    baseline, better, close = (perturbed(references, drop, seed) for drop, seed in ((0.3, 1), (0.1, 2), (0.3, 3)))
    resampled: list[np.ndarray] = []  # each system's resampled BLEU, as sacreBLEU hands them to estimate_ci
    estimate = sacrebleu.significance.estimate_ci

    def recording(scores: np.ndarray) -> tuple[float, float]:
        resampled.append(scores)
        return estimate(scores)

    monkeypatch.setattr(sacrebleu.significance, "estimate_ci", recording)
    test = paired_bootstrap([("base", baseline), ("better", better), ("close", close)], references)
    resampled_bleu = resampled[:]
    monkeypatch.undo()
    direct = sacrebleu_directly([baseline, better, close], references)
    assert [s.name for s in test.systems] == ["base", "better", "close"]
    for ours, theirs in zip(test.systems, direct, strict=True):
        assert (ours.score, ours.mean, ours.ci, ours.p_value) == (theirs.score, theirs.mean, theirs.ci, theirs.p_value)
    assert test.samples == 1000 and test.seed == 12345 and "bs:1000|seed:12345" in test.signature
    base, better_result, close_result = test.systems
    assert better_result.p_value < 0.05 and close_result.p_value >= 0.05  # both answers occur
    assert better_result.difference == pytest.approx(better_result.score - base.score)
    # the 95% interval of the difference: 1/40 in from either end of the differences of the same resamples
    for index, system in ((1, better_result), (2, close_result)):
        differences = np.sort(resampled_bleu[index] - resampled_bleu[0])
        assert system.difference_ci == pytest.approx((differences[25], differences[974]), abs=1e-9)
    assert better_result.difference_ci[0] > 0

    # the same numbers as `sacrebleu REF -i BASE SYS --paired-bs`
    files = {}
    for name, lines in (("ref", references), ("base", baseline), ("better", better)):
        files[name] = tmp_path / f"{name}.txt"
        files[name].write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    command = ["-m", "sacrebleu", str(files["ref"]), "-i", str(files["base"]), str(files["better"])]
    done = subprocess.run([sys.executable, *command, "--paired-bs", "-m", "bleu", "-f", "json"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    cli = [row["BLEU"] for row in json.loads(done.stdout)]
    expected = [(base.score, None), (better_result.score, better_result.p_value)]
    assert [(r["score"], r["p_value"]) for r in cli] == expected

    # SACREBLEU_SEED is sacreBLEU's, and without a fixed seed the resamples cannot be drawn again
    monkeypatch.setenv("SACREBLEU_SEED", "7")
    seeded = paired_bootstrap([("base", baseline), ("close", close)], references)
    assert seeded.systems[1].p_value == sacrebleu_directly([baseline, close], references)[1].p_value
    assert seeded.seed == 7 and "seed:7" in seeded.signature
    monkeypatch.setenv("SACREBLEU_SEED", "none")
    unseeded = paired_bootstrap([("base", baseline), ("close", close)], references)
    assert unseeded.seed is None and unseeded.systems[1].difference_ci is None
    with pytest.raises(ValueError, match="close: 99 hypotheses but 100 references"):
        paired_bootstrap([("base", baseline), ("close", close[:-1])], references)


@pytest.fixture
def smoke(smoke_run_dir: Path) -> Path:
    """The shared ``debug=smoke`` run (conftest's ``smoke_run_dir``)."""
    return smoke_run_dir


def test_aiayn_eval_compares_a_checkpoint_with_hypotheses_and_with_another_checkpoint(
    smoke: Path,
    references: list[str],
    corpus_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    step6, step12 = smoke / "checkpoints" / "step0000006.ckpt", smoke / "checkpoints" / "step0000012.ckpt"
    hypotheses = tmp_path / "system.de"
    system = perturbed(references, 0.2, 4)  # far better than 12 steps of training
    hypotheses.write_text("".join(line + "\n" for line in system), encoding="utf-8")
    # both checkpoints decode the same way: greedy, at most 3 tokens past the source length (seconds)
    common = [f"checkpoint={step12}", "split=test", f"data.root={corpus_root}", "decoding=greedy",
              "decoding.max_len_offset=3", f"output_dir={tmp_path / 'eval'}"]  # fmt: skip

    status, printed = eval_in_process([*common, f"compare={hypotheses}"], monkeypatch, capsys)
    assert status == 0, printed
    (written,) = (tmp_path / "eval").glob("step0000012.test.beam1-alpha0.0.*.json")
    report = json.loads(written.read_text())
    ours = read_lines(Path(report["hypotheses"]))
    (base, other) = sacrebleu_directly([ours, system], references)
    compared = report["compare"]
    assert (compared["kind"], compared["system"], compared["hypotheses"]) == (
        "hypotheses",
        str(hypotheses),
        str(hypotheses),
    )
    assert (report["sacrebleu"], compared["sacrebleu"]) == (pytest.approx(base.score), other.score)
    assert compared["p_value"] == other.p_value and compared["significant"] is (other.p_value < 0.05)
    assert compared["difference"] == pytest.approx(other.score - base.score)
    low, high = compared["difference_ci"]
    assert low <= compared["difference"] <= high
    assert "bs:1000|seed:12345" in compared["signature"]
    for shown in (f"{base.score:.2f}", f"{other.score:.2f}", f"{other.score - base.score:+.2f}",
                  f"95% CI [{low:+.2f}, {high:+.2f}]", f"p = {other.p_value:.4f}"):  # fmt: skip
        assert shown in printed, shown

    status, printed = eval_in_process([*common, f"compare={step6}"], monkeypatch, capsys)
    assert status == 0, printed
    (compared_with_step6,) = set((tmp_path / "eval").glob("*.json")) - {written}  # the first is still there
    report = json.loads(compared_with_step6.read_text())
    compared = report["compare"]
    assert compared["kind"] == "checkpoint" and compared["system"] == str(step6)
    assert compared["settings"] == report["settings"]  # decoded exactly as checkpoint= (item 9 of issue 26)
    theirs = read_lines(Path(compared["hypotheses"]))
    stem = compared_with_step6.name.removesuffix(".json")
    assert Path(compared["hypotheses"]).name == f"{stem}.compare-step0000006.hyp.txt"
    (base, other) = sacrebleu_directly([read_lines(Path(report["hypotheses"])), theirs], references)
    assert (compared["sacrebleu"], compared["p_value"]) == (other.score, other.p_value)
    assert compared["difference"] == pytest.approx(other.score - base.score)
    assert f"p = {other.p_value:.4f}" in printed and "95% CI [" in printed

    short = tmp_path / "short.de"
    short.write_text("eins\nzwei\n", encoding="utf-8")
    for value, message in (
        (short, f"aiayn-eval: error: compare={short} has 2 lines but there are 100 references"),
        (tmp_path / "none.de", f"aiayn-eval: error: compare={tmp_path / 'none.de'} is not a file"),
        ("3", "aiayn-eval: error: compare=3 must be a checkpoint (.ckpt) or a UTF-8 file of hypotheses"),
    ):
        status, printed = eval_in_process([*common, f"compare={value}"], monkeypatch, capsys)
        assert status == 2 and printed.startswith(message) and len(printed.strip().splitlines()) == 1, printed


def test_the_reports_p_value_is_sacrebleus_on_the_concatenated_seeds(
    smoke: Path, corpus_root: Path, tmp_path: Path
) -> None:
    # the references a smoke run's test.hyp.txt holds translations of: the split's first eval_limit lines
    tested = read_lines(corpus_root / "test_2016_flickr.de")[:16]
    assert len(read_lines(smoke / "test.hyp.txt")) == len(tested)
    drops = {"sinusoidal": 0.15, "learned": 0.35}
    systems = {}
    for positional, drop in drops.items():
        systems[positional] = []
        for seed in (1, 2, 3):
            hypotheses = perturbed(tested, drop, seed + 10 * len(systems))
            copy_run(
                smoke, tmp_path / "sweep" / f"model.positional={positional},seed={seed}", positional, seed, hypotheses
            )
            systems[positional] += hypotheses
    markdown = write_report([tmp_path / "sweep"], tmp_path / "report", data_root=corpus_root).markdown
    rows = table_rows(markdown)
    first, second = rows  # the first found (learned) is the baseline
    _, other = sacrebleu_directly([systems[first.split("=")[1]], systems[second.split("=")[1]]], tested * 3)
    assert rows[first]["p (test)"] == ""
    marker = "*" if other.p_value < 0.05 else ""
    assert rows[second]["p (test)"] == f"{other.p_value:.4f}{marker}"
    assert rows[second]["checkpoint"] == "best" and "BLEU (val, best)" not in rows[second]
    assert "concatenated in seed order and scored against the test references repeated" in markdown
