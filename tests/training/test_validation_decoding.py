"""The validations of a fit decode as ``val_decoding`` says (greedy: cheaper), the final validation and
the tests as ``decoding``; ``val_decoding=same`` (the experiments') follows ``decoding`` key by key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from omegaconf import OmegaConf

import aiayn.training.module as module_code
from aiayn.config.compose import compose_run_config
from aiayn.config.plan import module_settings
from aiayn.experiments.run import train
from helpers.runs import smoke_run, train_in_process


class DecodingCalls(pl.Callback):
    """Records the beam size of every batch the module translates, by (trainer function, stage); the
    module's own decoding runs unchanged."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.phase: tuple[str, str] | None = None
        self.calls: list[tuple[str, str, int]] = []
        real = module_code.translate_ids

        def recorded(model: Any, src: torch.Tensor, bos: int, eos: int, options: Any) -> list[list[int]]:
            self.calls.append((*self.phase, options.beam_size))
            return real(model, src, bos, eos, options)

        monkeypatch.setattr(module_code, "translate_ids", recorded)

    def on_validation_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        self.phase = (trainer.state.fn.value, "val")

    def on_test_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        self.phase = (trainer.state.fn.value, "test")


def test_validation_decodes_greedily_while_the_tests_search_with_beams(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Beam 2 for the tests (not the paper's 4, nor greedy's 1), so that each call says whose it is.
    short = ("decoding.max_len_offset=3", "val_decoding.max_len_offset=3", "checkpoint.average_last=0")
    overrides = smoke_run(corpus_root, cache_dir, "decoding.beam_size=2", "val_decoding=greedy", *short)
    spy = DecodingCalls(monkeypatch)
    results = train(compose_run_config(overrides), tmp_path, overrides, callbacks=[spy])

    beams: dict[tuple[str, str], set[int]] = {}
    for fn, stage, beam in spy.calls:
        beams.setdefault((fn, stage), set()).add(beam)
    # The two validations of the fit (after steps 6 and 12) greedy; after training, the validations of the
    # evaluated checkpoint and of the EMA's, and their tests, with the test decoding.
    assert beams == {("fit", "val"): {1}, ("validate", "val"): {2}, ("test", "test"): {2}}
    fit_batches = sum(1 for fn, stage, _ in spy.calls if fn == "fit")
    assert fit_batches == sum(1 for fn, _, _ in spy.calls if fn == "validate")
    assert (results["val_decoding"]["beam_size"], results["decoding"]["beam_size"]) == (1, 2)
    for name in ("best.ckpt", "last.ckpt"):  # aiayn-eval and aiayn-translate read the tests' decoding there
        stored = torch.load(tmp_path / "checkpoints" / name, map_location="cpu", weights_only=True)
        assert stored["hyper_parameters"]["decoding"]["beam_size"] == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["val_decoding=same"],
        ["val_decoding=same", "decoding=greedy"],
        ["val_decoding=same", "decoding=sample", "decoding.top_k=5"],
        ["val_decoding=same", "decoding.beam_size=7", "decoding.length_penalty=power"],
        ["experiment=paper/base_wmt14_en_de"],  # the experiments validate as they test, without saying so
        ["experiment=table3/B1"],
        ["experiment=mini/C2"],
    ],
)
def test_same_validation_decoding_follows_every_key_of_the_decoding(overrides: list[str]) -> None:
    cfg = compose_run_config(overrides)
    assert OmegaConf.to_container(cfg.val_decoding) == OmegaConf.to_container(cfg.decoding)
    assert set(cfg.val_decoding) == set(compose_run_config(["decoding=sample"]).decoding)


@pytest.mark.parametrize("option", ["greedy", "paper"])
def test_a_validation_decoding_option_is_the_decoding_option_of_that_name(option: str) -> None:
    validation = compose_run_config([f"val_decoding={option}", "decoding=sample"]).val_decoding
    assert OmegaConf.to_container(validation) == OmegaConf.to_container(
        compose_run_config([f"decoding={option}"]).decoding
    )


def test_validations_that_would_sample_are_refused_in_one_line(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)  # a run folder, if one were made, would go to ./outputs
    assert train_in_process(smoke_run(corpus_root, cache_dir, "decoding=sample", "val_decoding=same"), monkeypatch) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("aiayn-train: error: val_decoding.sample=true cannot rank checkpoints by chance draws")
    assert "val_decoding=greedy" in line
    assert not [folder for folder in tmp_path.glob("outputs/*/*") if folder.is_dir()]  # no run folder left
    # The tests may still sample when the validations search.
    settings = module_settings(compose_run_config(["decoding=sample", "val_decoding=greedy"]))
    assert settings.decoding.sample and not settings.val_decoding.sample and settings.val_decoding.beam_size == 1
