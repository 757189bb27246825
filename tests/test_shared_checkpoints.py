"""A checkpoint from somebody else runs no code: the config stored in it builds only aiayn's own data
modules and corpora, whatever ``_target_`` it holds and wherever; its strings are not interpolated."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from aiayn.config.build import model_config, module_kwargs
from aiayn.config.compose import compose_run_config
from aiayn.data.corpus import read_parallel
from aiayn.data.tokenizer import Tokenizer
from aiayn.training.checkpoints import RUN_KEY
from aiayn.training.module import TranslationModule
from helpers.runs import smoke_run


def checkpoint_with(folder: Path, corpus_root: Path, cache_dir: Path, data: dict[str, Any] | None = None) -> Path:
    """An untrained smoke-sized model saved as aiayn-train saves one, with ``data`` as its stored data section."""
    cfg = compose_run_config(smoke_run(corpus_root, cache_dir))
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if data is not None:
        resolved["data"] = data
    source, target = read_parallel(corpus_root / "train.en", corpus_root / "train.de")
    tokenizer = Tokenizer.train(source + target, cfg.data.vocab_size, folder / "spm.model")
    module = TranslationModule(**module_kwargs(cfg))
    path = folder / "shared.ckpt"
    torch.save(
        {
            "state_dict": module.state_dict(),
            "hyper_parameters": {"model": model_config(cfg)},
            RUN_KEY: {"config": resolved, "tokenizer": tokenizer.to_bytes()},
        },
        path,
    )
    return path


def evaluate(checkpoint: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "aiayn.cli.evaluate", f"checkpoint={checkpoint}", "decoding=greedy", *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def stored_data(corpus_root: Path, cache_dir: Path) -> dict[str, Any]:
    cfg = compose_run_config(smoke_run(corpus_root, cache_dir))
    return OmegaConf.to_container(cfg.data, resolve=True)


@pytest.mark.parametrize(
    ("where", "key"),
    [
        ("nested", "data.corpus._target_"),
        ("top", "data._target_"),
        ("in a list", "data.extra[1]._target_"),
        ("project function", "data.corpus._target_"),
    ],
)
def test_a_stored_target_outside_aiayns_classes_is_refused_before_it_runs(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, where: str, key: str
) -> None:
    victim = tmp_path / "created-by-the-checkpoint"
    data = stored_data(corpus_root, cache_dir)
    makedirs = {"_target_": "os.makedirs", "name": str(victim)}
    if where == "nested":
        data["corpus"] = makedirs
    elif where == "top":
        data = makedirs
    elif where == "in a list":
        data["extra"] = [1, makedirs]
    else:  # aiayn's own code, but not a data module or corpus: it writes a file
        data["corpus"] = {"_target_": "aiayn.files.atomic_write", "path": str(victim), "content": "x"}
    result = evaluate(checkpoint_with(tmp_path, corpus_root, cache_dir, data), "split=test")
    assert result.returncode == 2, result.stderr
    assert not victim.exists()
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("aiayn-eval: error: checkpoint ") and f"sets {key}=" in line


def test_stored_strings_are_not_interpolated(tmp_path: Path, corpus_root: Path, cache_dir: Path) -> None:
    data = stored_data(corpus_root, cache_dir)
    data["src_lang"] = "${oc.env:HOME}"  # a resolver: read as text, it names no language
    result = evaluate(checkpoint_with(tmp_path, corpus_root, cache_dir, data), "split=test", f"data.root={corpus_root}")
    assert result.returncode == 2
    assert "${oc.env:HOME}" in result.stderr and str(Path.home()) not in result.stderr


def test_the_runs_own_data_section_still_evaluates(tmp_path: Path, corpus_root: Path, cache_dir: Path) -> None:
    checkpoint = checkpoint_with(tmp_path, corpus_root, cache_dir)
    result = evaluate(checkpoint, "split=test", f"data.root={corpus_root}", f"output_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    (hypotheses,) = tmp_path.glob("shared.test.beam1-alpha0.0.*.hyp.txt")
    assert len(hypotheses.read_text().splitlines()) == 100


@pytest.mark.parametrize("damage", ["unknown field", "other shapes"])
def test_a_checkpoint_whose_model_cannot_be_built_is_refused_in_one_line(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, damage: str
) -> None:
    path = checkpoint_with(tmp_path, corpus_root, cache_dir)
    checkpoint = torch.load(path, weights_only=True)
    if damage == "unknown field":
        checkpoint["hyper_parameters"]["model"]["evil"] = 1
    else:
        checkpoint["hyper_parameters"]["model"]["d_ff"] *= 2
    torch.save(checkpoint, path)
    result = evaluate(path, "split=test")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    prefix = f"aiayn-eval: error: checkpoint {path}: hyper_parameters.model holds a model aiayn cannot build"
    assert line.startswith(prefix)


@pytest.mark.parametrize("data", ["a string", [1, 2], {"root": "/somewhere"}])
def test_a_checkpoint_without_a_data_section_to_build_is_refused_in_one_line(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, data: Any
) -> None:
    result = evaluate(checkpoint_with(tmp_path, corpus_root, cache_dir, data), "split=test")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "holds no data section to evaluate a split of" in line
