"""aiayn from a notebook: ``aiayn.load`` translates, lists the n best and scores as the translator and the
scorer do; ``aiayn.train`` trains as aiayn-train does and raises what it would refuse; ``aiayn.runs``
gives the report's rows as numbers, writing nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import aiayn
from aiayn.data.corpus import read_lines
from aiayn.errors import ConfigError
from aiayn.evaluation.translator import Translator, load_translation_model
from aiayn.model import DecodingOptions
from aiayn.scoring import corpus_scores
from helpers.runs import smoke_run

BEAM2 = {"beam_size": 2, "max_len_offset": 3}


def test_import_aiayn_stays_light() -> None:
    """The API is imported on first use: ``import aiayn`` pulls in neither torch nor Lightning."""
    code = "import sys, aiayn; print(sorted(m for m in ('torch', 'pytorch_lightning') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_a_loaded_checkpoint_translates_lists_and_scores_as_the_tools_do(
    smoke_run_dir: Path, corpus_root: Path
) -> None:
    checkpoint = smoke_run_dir / "checkpoints" / "best.ckpt"
    lines = read_lines(corpus_root / "test_2016_flickr.en")[:6]
    references = read_lines(corpus_root / "test_2016_flickr.de")[:6]
    loaded = aiayn.load(checkpoint, device="cpu", decoding=BEAM2)
    model, tokenizer, _ = load_translation_model(checkpoint)
    ours = Translator(model, tokenizer, DecodingOptions(**BEAM2), nbest=2)
    assert loaded.translate(lines) == ours.translate(lines) and loaded.translate(lines[0]) == ours.translate(lines)[0]
    assert loaded.nbest(lines, 2) == ours.candidates(lines)
    assert loaded.score(lines, references) == corpus_scores(ours.translate(lines), references)
    with pytest.raises(ConfigError, match=r"^nbest=3 must be a whole number from 1 to the beam size \(2\)"):
        loaded.nbest(lines, 3)
    with pytest.raises(ConfigError, match=r"^decoding\.beam_size=0 must be a whole number >= 1"):
        aiayn.load(checkpoint, decoding={"beam_size": 0})


def test_the_report_rows_come_back_as_numbers_and_nothing_is_written(smoke_run_dir: Path) -> None:
    before = sorted(path.relative_to(smoke_run_dir) for path in smoke_run_dir.rglob("*"))
    (row,) = aiayn.runs(smoke_run_dir)
    results = json.loads((smoke_run_dir / "results.json").read_text())
    assert row["val_bleu"] == {"mean": results["val_bleu"], "std": None, "n": 1} and row["seeds"] == 1
    assert sorted(path.relative_to(smoke_run_dir) for path in smoke_run_dir.rglob("*")) == before


def test_a_refused_run_raises_naming_the_key_and_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIAYN_OUTPUT", str(tmp_path / "outputs"))
    with pytest.raises(ConfigError, match=r"^model\.d_model=511 must be even"):
        aiayn.train(["model=tiny", "model.d_model=511"])
    assert not (tmp_path / "outputs").exists() or list((tmp_path / "outputs").iterdir()) == []


@pytest.mark.slow
def test_a_run_trained_from_python_returns_its_results(corpus_root: Path, cache_dir: Path, tmp_path: Path) -> None:
    overrides = [*smoke_run(corpus_root, cache_dir), "trainer.max_steps=2", "checkpoint.average_last=0"]
    results = aiayn.train([*overrides, "decoding=greedy", "decoding.max_len_offset=2"], run_dir=tmp_path / "run")
    assert results["steps"] == 2 and results == json.loads((tmp_path / "run" / "results.json").read_text())
