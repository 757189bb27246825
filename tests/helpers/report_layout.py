"""Runs of a sweep made without training them: a finished run copied as another setting and seed, with test
translations of a chosen quality, and the table of the report written over them."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import yaml

from aiayn.files import TEST_TRANSLATIONS


def perturbed(lines: list[str], drop: float, seed: int) -> list[str]:
    """``lines`` with each word dropped with probability ``drop``: a system of a chosen quality."""
    rng = random.Random(seed)
    return [" ".join(word for word in line.split() if rng.random() >= drop) for line in lines]


def table_rows(markdown: str) -> dict[str, dict[str, str]]:
    """The report's table: setting -> heading -> cell."""
    header, _, *rows = ([cell.strip() for cell in line.strip("|").split("|")]
                        for line in markdown.splitlines() if line.startswith("|"))  # fmt: skip
    return {row[0]: dict(zip(header, row, strict=True)) for row in rows}


def copy_run(run: Path, folder: Path, positional: str, seed: int, hypotheses: list[str]) -> Path:
    """``run`` as if trained with ``model.positional`` and ``seed``, its test translations ``hypotheses``:
    a setting of a sweep without training one."""
    shutil.copytree(run, folder, ignore=shutil.ignore_patterns("checkpoints", "run.lock", "csv"))
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config["seed"], config["model"]["positional"] = seed, positional
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    results = json.loads((folder / "results.json").read_text())
    results["overrides"] = [*results["overrides"], f"model.positional={positional}", f"seed={seed}"]
    (folder / "results.json").write_text(json.dumps(results))
    # the answer's translations (the report's p-values are of them): test.ema.hyp.txt for an EMA answer,
    # test.hyp.txt for the evaluated checkpoint's (results.json names it by its checkpoint: best or final)
    answer = TEST_TRANSLATIONS.get(results.get("answer"), TEST_TRANSLATIONS["evaluated"])
    (folder / answer).write_text("".join(line + "\n" for line in hypotheses), encoding="utf-8")
    return folder
