"""BLEU that a run reported, checked against sacreBLEU itself run on the run's own hypothesis files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import sacrebleu

# results.json's test scores and the files holding the translations they score
HYPOTHESIS_FILES = {"test_bleu": "test.hyp.txt", "test_bleu_averaged": "test.averaged.hyp.txt"}


def sacrebleu_of(hypotheses: Path, references: Sequence[str]) -> tuple[float, str]:
    """sacreBLEU with its default settings (13a tokenization, cased, exp smoothing) of the lines of the file
    ``hypotheses`` against ``references``, one line each, and its signature."""
    lines = hypotheses.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(references), f"{hypotheses} has {len(lines)} lines for {len(references)} references"
    bleu = sacrebleu.BLEU()
    return bleu.corpus_score(lines, [list(references)]).score, str(bleu.get_signature())


def assert_reported_bleu(run_dir: Path, results: dict[str, Any], references: Sequence[str]) -> None:
    """Each test BLEU in ``results`` (results.json of ``run_dir``; ``test_bleu_averaged`` only where the run
    averaged checkpoints) is sacreBLEU's of its hypothesis file against ``references``, with the signature
    the run recorded."""
    reported = [key for key in HYPOTHESIS_FILES if key in results]
    assert "test_bleu" in reported, sorted(results)
    for key in reported:
        score, signature = sacrebleu_of(run_dir / HYPOTHESIS_FILES[key], references)
        assert results[key] == pytest.approx(score, abs=1e-9), key
        assert results["sacrebleu_signature"] == signature
