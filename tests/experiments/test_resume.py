"""A run stopped mid-epoch and resumed (or requeued: the same folder again) ends exactly where an
uninterrupted run ends."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aiayn.config.compose import compose_run_config
from aiayn.experiments.run import train
from helpers.batch_recorder import BatchRecorder, recorded
from helpers.runs import resumable_run
from helpers.stops import StopAtStep

pytestmark = pytest.mark.slow


def run(tmp: Path, name: str, overrides: list[str]) -> tuple[dict, Path]:
    run_dir = tmp / name
    results = train(compose_run_config(overrides), run_dir, overrides, callbacks=[BatchRecorder(str(run_dir))])
    return results, run_dir


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[list[str]], tuple[dict, Path]]:
    """The 16-step run of some overrides, trained once per module for the cases that share it."""
    runs: dict[tuple[str, ...], tuple[dict, Path]] = {}

    def whole(overrides: list[str]) -> tuple[dict, Path]:
        if tuple(overrides) not in runs:
            runs[tuple(overrides)] = run(tmp_path_factory.mktemp("whole"), "run", [*overrides, "trainer.max_steps=16"])
        return runs[tuple(overrides)]

    return whole


@pytest.mark.parametrize(
    ("stop", "how", "extra"),
    [
        (7, "requeued", []),  # mid-epoch; the same folder again, no resume key (a requeued SLURM job)
        (7, "asked", ["data.num_workers=1"]),  # a callback asks to stop (the timer's way), worker processes
        ("epoch end", "max_steps", ["data.num_workers=1"]),  # exactly at the end of the first epoch
        (5, "max_steps", ["trainer.accumulate_grad_batches=2"]),  # 10 of the first epoch's batches
    ],
)
def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_run(
    tmp_path: Path,
    multi30k_root: Path,
    cache_dir: Path,
    uninterrupted: Callable[[list[str]], tuple[dict, Path]],
    stop: int | str,
    how: str,
    extra: list[str],
) -> None:
    # The uninterrupted run loads its batches in this process: worker processes change no batch and no mask.
    batching = [setting for setting in extra if not setting.startswith("data.num_workers")]
    whole, whole_dir = uninterrupted(resumable_run(multi30k_root, cache_dir, *batching))
    base = resumable_run(multi30k_root, cache_dir, *extra)
    records = recorded(whole_dir)
    per_epoch = max(record["step"] for record in records if record["epoch"] == 0) + 1  # optimizer steps
    stop = per_epoch if stop == "epoch end" else stop
    assert stop <= per_epoch < 16  # the stop is in (or at the end of) the first epoch; the run goes on
    first_dir = tmp_path / "first"
    if how == "asked":
        overrides = [*base, "trainer.max_steps=16"]
        recorder = BatchRecorder(str(first_dir))
        train(compose_run_config(overrides), first_dir, overrides, callbacks=[recorder, StopAtStep(stop)])
    else:
        run(tmp_path, "first", [*base, f"trainer.max_steps={stop}"])
    first_records = recorded(first_dir)
    if how == "requeued":
        second, second_dir = run(tmp_path, "first", [*base, "trainer.max_steps=16"])
        second_records = recorded(second_dir)[len(first_records) :]
    else:
        resume = f"resume={first_dir / 'checkpoints' / 'last.ckpt'}"
        second, second_dir = run(tmp_path, "second", [*base, "trainer.max_steps=16", resume])
        second_records = recorded(second_dir)

    batches = [record["index"] for record in records]
    done = len(first_records)
    assert [record["step"] for record in first_records][-1] == stop - 1
    # the resumed run continues with the next batch and sees exactly the rest
    assert [record["index"] for record in first_records] == batches[:done]
    assert [record["index"] for record in second_records] == batches[done:]
    assert second["steps"] == whole["steps"] == 16
    assert second["resumed_from"] == str(first_dir / "checkpoints" / "last.ckpt")
    assert second["train_tokens"] == whole["train_tokens"]  # counted over both parts
    expected, actual = weights(whole_dir), weights(second_dir)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
