"""A run stopped mid-epoch and resumed ends exactly where an uninterrupted run ends."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from aiayn.config.compose import compose_run_config
from aiayn.experiments.run import train
from helpers.batch_recorder import BatchRecorder, recorded
from helpers.runs import resumable_run

pytestmark = pytest.mark.slow


def run(tmp: Path, name: str, overrides: list[str]) -> tuple[dict, Path]:
    run_dir = tmp / name
    results = train(compose_run_config(overrides), run_dir, overrides, callbacks=[BatchRecorder(str(run_dir))])
    return results, run_dir


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


class StopAtStep(pl.Callback):
    """Asks the trainer to stop after ``step`` optimizer steps, as Lightning's timer does at max_time."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


@pytest.mark.parametrize(
    ("stop", "how", "extra"),
    [
        (7, "max_steps", []),  # mid-epoch
        (7, "asked", ["data.num_workers=1"]),  # a callback asks to stop (the timer's way), worker processes
        ("epoch end", "max_steps", ["data.num_workers=1"]),  # exactly at the end of the first epoch
        (5, "max_steps", ["trainer.accumulate_grad_batches=2"]),  # 10 of the first epoch's batches
    ],
)
def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_run(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path, stop: int | str, how: str, extra: list[str]
) -> None:
    base = resumable_run(multi30k_root, cache_dir, *extra)
    whole, whole_dir = run(tmp_path, "whole", [*base, "trainer.max_steps=16"])
    records = recorded(whole_dir)
    per_epoch = max(record["step"] for record in records if record["epoch"] == 0) + 1  # optimizer steps
    stop = per_epoch if stop == "epoch end" else stop
    assert stop <= per_epoch < 16  # the stop is in (or at the end of) the first epoch; the run goes on
    if how == "max_steps":
        _, first_dir = run(tmp_path, "first", [*base, f"trainer.max_steps={stop}"])
    else:
        first_dir = tmp_path / "first"
        overrides = [*base, "trainer.max_steps=16"]
        recorder = BatchRecorder(str(first_dir))
        train(compose_run_config(overrides), first_dir, overrides, callbacks=[recorder, StopAtStep(stop)])
    resume = f"resume={first_dir / 'checkpoints' / 'last.ckpt'}"
    second, second_dir = run(tmp_path, "second", [*base, "trainer.max_steps=16", resume])

    batches = [record["index"] for record in records]
    done = len(recorded(first_dir))
    assert [record["step"] for record in recorded(first_dir)][-1] == stop - 1
    # the resumed run continues with the next batch and sees exactly the rest
    assert [record["index"] for record in recorded(first_dir)] == batches[:done]
    assert [record["index"] for record in recorded(second_dir)] == batches[done:]
    assert second["steps"] == whole["steps"] == 16 and second["resumed_from"].endswith("last.ckpt")
    assert second["train_tokens"] == whole["train_tokens"]  # counted over both parts
    expected, actual = weights(whole_dir), weights(second_dir)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_a_run_folder_with_a_last_checkpoint_continues_from_it(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path
) -> None:
    """What a requeued SLURM job does: the same command, the same folder, no resume key."""
    base = resumable_run(multi30k_root, cache_dir)
    _, run_dir = run(tmp_path, "run", [*base, "trainer.max_steps=5"])
    again, _ = run(tmp_path, "run", [*base, "trainer.max_steps=9"])
    steps = [record["step"] for record in recorded(run_dir)]
    assert steps == list(range(9))  # no step twice, none left out
    assert again["resumed_from"] == str(run_dir / "checkpoints" / "last.ckpt") and again["steps"] == 9
