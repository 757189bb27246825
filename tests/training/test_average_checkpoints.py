"""``checkpoint.average_every``: step checkpoints every N optimizer steps without a validation, their
retention and average (§6.1), across a resume; and no near-duplicate step checkpoint from a run that
stops early right after one, whatever spaces them."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from aiayn.config.compose import compose_run_config
from aiayn.experiments.run import train
from aiayn.training.callbacks.ema import EVALUATION_KEYS
from aiayn.training.checkpoints import load_checkpoint, step_checkpoints
from helpers.runs import refusal, smoke_run
from helpers.stops import StopAtStep

WEIGHTS_ONLY = {*EVALUATION_KEYS, "state_dict"}  # an average_every snapshot's entries: those of ema.ckpt
# Greedy and short: the decoding is not what these tests check.
FAST = ("decoding=greedy", "decoding.max_len_offset=3")


class FitValidations(pl.Callback):
    """Counts the validations of the fit (the evaluations after it are not fits)."""

    def __init__(self) -> None:
        self.count = 0

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.count += trainer.state.fn == "fit" and not trainer.sanity_checking


def steps_in(run_dir: Path) -> list[int]:
    return [int(path.stem.removeprefix("step")) for path in step_checkpoints(run_dir)]


def test_average_every_checkpoints_between_validations_and_averages_the_newest(
    tmp_path: Path, corpus_root: Path, cache_dir: Path
) -> None:
    every = ("checkpoint.average_every=2", "checkpoint.keep_last=6", "checkpoint.average_last=4")
    overrides = smoke_run(corpus_root, cache_dir, *FAST, *every)
    validations = FitValidations()
    results = train(compose_run_config(overrides), tmp_path, overrides, callbacks=[validations])

    assert steps_in(tmp_path) == [2, 4, 6, 8, 10, 12]
    assert validations.count == 2  # after steps 6 and 12, as without average_every
    averaged = load_checkpoint(tmp_path / "checkpoints" / "averaged.ckpt")
    assert [source["global_step"] for source in averaged["averaged_from"]] == [6, 8, 10, 12]
    assert results["averaged_checkpoints"] == [f"step{step:07d}.ckpt" for step in (6, 8, 10, 12)]
    name = next(name for name, tensor in averaged["state_dict"].items() if tensor.is_floating_point())
    sources = [load_checkpoint(tmp_path / "checkpoints" / f"step{step:07d}.ckpt") for step in (6, 8, 10, 12)]
    for source, step in zip(sources, (6, 8, 10, 12), strict=True):
        assert source["global_step"] == step and set(source) == WEIGHTS_ONLY  # the training state is last.ckpt's
    mean = sum(source["state_dict"][name].double() for source in sources) / 4
    torch.testing.assert_close(averaged["state_dict"][name], mean.float())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "stop", "expected"),
    [
        (["checkpoint.average_every=4"], 9, [4, 8]),  # 1 step after 8: less than half of 4, skipped
        (["checkpoint.average_every=4"], 10, [4, 8, 10]),  # half a spacing after 8: kept
        (["checkpoint.average_every=4", "trainer.max_steps=9"], None, [4, 8, 9]),  # the planned end: kept
        ([], 7, [6]),  # validations every 6 steps: the stop's validation at 7 adds no step checkpoint
    ],
)
def test_an_early_stop_right_after_a_step_checkpoint_adds_no_near_duplicate(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, extra: list[str], stop: int | None, expected: list[int]
) -> None:
    overrides = smoke_run(corpus_root, cache_dir, *FAST, "checkpoint.keep_last=5", *extra)
    stops = [StopAtStep(stop)] if stop else []
    results = train(compose_run_config(overrides), tmp_path, overrides, callbacks=stops)
    assert results["steps"] == (stop or 9)
    assert steps_in(tmp_path) == expected
    assert load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == results["steps"]


@pytest.mark.slow
def test_a_resumed_run_keeps_the_spacing_and_prunes_the_earlier_part(
    tmp_path: Path, corpus_root: Path, cache_dir: Path
) -> None:
    every = ("checkpoint.average_every=3", "checkpoint.keep_last=3", "checkpoint.average_last=3")
    # Accumulated batches: the resumed run's first batch ends no optimizer step, and must write nothing.
    overrides = smoke_run(corpus_root, cache_dir, *FAST, *every, "trainer.accumulate_grad_batches=2")
    train(compose_run_config(overrides), tmp_path, overrides, callbacks=[StopAtStep(6)])
    assert steps_in(tmp_path) == [3, 6]
    sixth = tmp_path / "checkpoints" / "step0000006.ckpt"
    written = sixth.stat().st_mtime_ns

    results = train(compose_run_config(overrides), tmp_path, overrides)  # the folder's last.ckpt: continued
    assert results["resumed_from"] and results["steps"] == 12
    assert steps_in(tmp_path) == [6, 9, 12]  # step 3 pruned by the restored tracker, keep_last=3
    assert sixth.stat().st_mtime_ns == written
    assert results["averaged_checkpoints"] == ["step0000006.ckpt", "step0000009.ckpt", "step0000012.ckpt"]


@pytest.mark.parametrize("value", ["0", "-2", "true"])
def test_a_bad_average_every_stops_in_one_line_naming_the_key(
    value: str,
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.chdir(tmp_path)
    overrides = smoke_run(corpus_root, cache_dir, f"checkpoint.average_every={value}")
    assert refusal(overrides, monkeypatch, capsys) == (
        f"checkpoint.average_every={value} must be a whole number of optimizer steps >= 1, "
        "or null (step checkpoints at validations)"
    )
