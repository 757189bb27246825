"""The attention kernels are the run's choice (``sdpa_backends``), set when a fit, a validation and a test
start, on any machine: by default not cuDNN's, which builds a graph per new batch shape; flash,
memory-efficient and math attention allowed. (tests/scenarios/test_cuda.py checks which kernel a GPU then
runs.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from aiayn.config.compose import compose_run_config
from aiayn.errors import FieldError
from aiayn.experiments.run import train
from aiayn.model import SDPA_BACKENDS
from aiayn.training.callbacks.sdpa import SdpaBackends
from helpers.runs import resumable_run

FLAGS = {
    "flash": torch.backends.cuda.flash_sdp_enabled,
    "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
    "cudnn": torch.backends.cuda.cudnn_sdp_enabled,
    "math": torch.backends.cuda.math_sdp_enabled,
}


def allowed() -> set[str]:
    return {name for name, enabled in FLAGS.items() if enabled()}


@pytest.fixture(autouse=True)
def torch_defaults() -> Iterator[None]:
    """Every kernel allowed, as torch starts (cuDNN's included), and the switches as they were afterwards."""
    before = allowed()
    for enable in SDPA_BACKENDS.values():
        enable(True)
    yield
    for name, enable in SDPA_BACKENDS.items():
        enable(name in before)


class Allowed(pl.Callback):
    """The kernels allowed when training, validation and testing start; between them it allows every
    kernel again, so that each stage must set its own."""

    def __init__(self) -> None:
        self.seen: dict[str, set[str]] = {}

    def on_train_start(self, *args: Any) -> None:
        self.seen["train"] = allowed()

    def on_validation_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seen.setdefault(f"validate ({trainer.state.fn.value})", allowed())

    def on_test_start(self, *args: Any) -> None:
        self.seen["test"] = allowed()

    def on_fit_end(self, *args: Any) -> None:
        for enable in SDPA_BACKENDS.values():
            enable(True)

    on_validation_end = on_test_end = on_fit_end


def test_a_run_allows_every_kernel_but_cudnns_in_training_validation_and_test(
    tmp_path: Path, corpus_root: Path, cache_dir: Path
) -> None:
    assert torch.backends.cuda.cudnn_sdp_enabled()
    overrides = resumable_run(corpus_root, cache_dir, "trainer.max_steps=2", "checkpoint.every_steps=2", pairs=100)
    stages = Allowed()
    train(compose_run_config(overrides), tmp_path / "run", overrides, callbacks=[stages])
    assert stages.seen == {
        "train": {"flash", "efficient", "math"},
        "validate (fit)": {"flash", "efficient", "math"},
        "validate (validate)": {"flash", "efficient", "math"},
        "test": {"flash", "efficient", "math"},
    }


@pytest.mark.parametrize("backends", [["math"], ["cudnn", "flash"], ["flash", "efficient", "cudnn", "math"]])
def test_the_setting_allows_exactly_the_kernels_it_names(backends: list[str]) -> None:
    SdpaBackends(backends).setup(pl.Trainer(accelerator="cpu", logger=False), pl.LightningModule(), "fit")
    assert allowed() == set(backends)


@pytest.mark.parametrize("backends", [[], ["fast"], "flash", None, [1]])
def test_a_setting_that_is_not_a_list_of_kernels_is_refused_naming_the_key(backends: Any) -> None:
    with pytest.raises(FieldError, match=r"^sdpa_backends=.* must be a list of one or more of flash, efficient"):
        SdpaBackends(backends)
