"""A checkpoint from somebody else runs no code: the config stored in it builds only aiayn's own data
modules and corpora, whatever ``_target_`` it holds and wherever; its strings are not interpolated."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from aiayn.cli import evaluate as evaluate_cli
from aiayn.config.compose import compose_run_config
from aiayn.config.plan import module_settings
from aiayn.data.corpus import read_parallel
from aiayn.data.tokenizer import Tokenizer
from aiayn.training.checkpoints import RUN_KEY
from helpers.runs import exit_status, smoke_run


@pytest.fixture(scope="module")
def untrained(corpus_root: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An untrained smoke-sized model as aiayn-train saves one: its tokenizer trained once for this file."""
    cfg = compose_run_config(smoke_run(corpus_root, cache_dir))
    source, target = read_parallel(corpus_root / "train.en", corpus_root / "train.de")
    tokenizer = Tokenizer.train(source + target, cfg.data.vocab_size, tmp_path_factory.mktemp("spm") / "spm.model")
    settings = module_settings(cfg)
    with torch.random.fork_rng():  # seeded, without changing what the generators give the next test
        torch.manual_seed(0)
        state_dict = settings.build().state_dict()
    return {
        "state_dict": state_dict,
        "hyper_parameters": {"model": settings.model.to_dict()},
        RUN_KEY: {"config": OmegaConf.to_container(cfg, resolve=True), "tokenizer": tokenizer.to_bytes()},
    }


def checkpoint_with(folder: Path, untrained: dict[str, Any], data: Any = None) -> Path:
    """The untrained model's checkpoint in ``folder``, with ``data`` (unless None) as its stored data section."""
    checkpoint = copy.deepcopy(untrained)
    if data is not None:
        checkpoint[RUN_KEY]["config"]["data"] = data
    path = folder / "shared.ckpt"
    torch.save(checkpoint, path)
    return path


def stored_data(untrained: dict[str, Any]) -> dict[str, Any]:
    """The data section aiayn-train stored: the smoke run's, resolved."""
    return copy.deepcopy(untrained[RUN_KEY]["config"]["data"])


# Greedy and at most 3 tokens past the source: an untrained model's translations run to the length limit.
FAST = ("decoding=greedy", "decoding.max_len_offset=3")


def evaluate_process(checkpoint: Path, *overrides: str) -> tuple[int, str]:
    """The console script in its own process: its exit status and stderr."""
    command = [sys.executable, "-m", "aiayn.cli.evaluate", f"checkpoint={checkpoint}", *FAST, *overrides]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr


@pytest.fixture
def evaluate(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> Callable[..., tuple[int, str]]:
    """``evaluate(checkpoint, *overrides)``: ``aiayn-eval`` in this process (where it would create a file or
    a folder just as in its own), its exit status and stderr."""

    def run(checkpoint: Path, *overrides: str) -> tuple[int, str]:
        status = exit_status(
            evaluate_cli.main, ["aiayn-eval", f"checkpoint={checkpoint}", *FAST, *overrides], monkeypatch
        )
        return status, capsys.readouterr().err

    return run


@pytest.mark.slow
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
    tmp_path: Path, untrained: dict[str, Any], evaluate: Callable[..., tuple[int, str]], where: str, key: str
) -> None:
    """The nested case through the console script in its own process (the status a shell sees), the
    others in this process."""
    victim = tmp_path / "created-by-the-checkpoint"
    data = stored_data(untrained)
    makedirs = {"_target_": "os.makedirs", "name": str(victim)}
    if where == "nested":
        data["corpus"] = makedirs
    elif where == "top":
        data = makedirs
    elif where == "in a list":
        data["extra"] = [1, makedirs]
    else:  # aiayn's own code, but not a data module or corpus: it writes a file
        data["corpus"] = {"_target_": "aiayn.files.atomic_write", "path": str(victim), "content": "x"}
    checkpoint = checkpoint_with(tmp_path, untrained, data)
    status, err = (evaluate_process if where == "nested" else evaluate)(checkpoint, "split=test")
    assert status == 2, err
    assert not victim.exists()
    (line,) = err.strip().splitlines()
    assert line.startswith("aiayn-eval: error: checkpoint ") and f"sets {key}=" in line


def test_stored_strings_are_not_interpolated(
    tmp_path: Path, corpus_root: Path, untrained: dict[str, Any], evaluate: Callable[..., tuple[int, str]]
) -> None:
    data = stored_data(untrained)
    data["src_lang"] = "${oc.env:HOME}"  # a resolver: read as text, it names no language
    status, err = evaluate(checkpoint_with(tmp_path, untrained, data), "split=test", f"data.root={corpus_root}")
    assert status == 2
    assert "${oc.env:HOME}" in err and str(Path.home()) not in err


def test_the_runs_own_data_section_still_evaluates(
    tmp_path: Path, corpus_root: Path, untrained: dict[str, Any], evaluate: Callable[..., tuple[int, str]]
) -> None:
    checkpoint = checkpoint_with(tmp_path, untrained)
    status, err = evaluate(checkpoint, "split=test", f"data.root={corpus_root}", f"output_dir={tmp_path}")
    assert status == 0, err
    (hypotheses,) = tmp_path.glob("shared.test.beam1-alpha0.0.*.hyp.txt")
    assert len(hypotheses.read_text().splitlines()) == 100


@pytest.mark.parametrize("damage", ["unknown field", "other shapes"])
def test_a_checkpoint_whose_model_cannot_be_built_is_refused_in_one_line(
    tmp_path: Path, untrained: dict[str, Any], evaluate: Callable[..., tuple[int, str]], damage: str
) -> None:
    path = checkpoint_with(tmp_path, untrained)
    checkpoint = torch.load(path, weights_only=True)
    if damage == "unknown field":
        checkpoint["hyper_parameters"]["model"]["evil"] = 1
    else:
        checkpoint["hyper_parameters"]["model"]["d_ff"] *= 2
    torch.save(checkpoint, path)
    status, err = evaluate(path, "split=test")
    assert status == 2
    (line,) = err.strip().splitlines()
    prefix = f"aiayn-eval: error: checkpoint {path}: hyper_parameters.model holds a model aiayn cannot build"
    assert line.startswith(prefix)


@pytest.mark.parametrize("data", ["a string", [1, 2], {"root": "/somewhere"}])
def test_a_checkpoint_without_a_data_section_to_build_is_refused_in_one_line(
    tmp_path: Path, untrained: dict[str, Any], evaluate: Callable[..., tuple[int, str]], data: Any
) -> None:
    status, err = evaluate(checkpoint_with(tmp_path, untrained, data), "split=test")
    assert status == 2
    (line,) = err.strip().splitlines()
    assert "holds no data section to evaluate a split of" in line
