"""A run stopped mid-epoch and resumed ends exactly where an uninterrupted run ends."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aiayn.train import train
from batch_recorder import BatchRecorder, recorded
from composed import compose_run_config

pytestmark = pytest.mark.slow


def settings(root: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "model=tiny",
        f"data.root={root}",
        f"data.cache_dir={cache}",
        "data.vocab_size=1000",
        "data.train_limit=200",
        "data.eval_limit=16",
        "data.max_tokens=500",
        "logger=none",
        "progress=quiet",
        "decoding=greedy",
        "dashboard.attention_every=0",
        "checkpoint.average_last=0",
        "trainer.log_every_n_steps=1",
        "trainer.deterministic=true",
        *extra,
    ]


def run(tmp: Path, name: str, overrides: list[str]) -> tuple[dict, Path]:
    run_dir = tmp / name
    results = train(compose_run_config(overrides), run_dir, overrides, callbacks=[BatchRecorder(str(run_dir))])
    return results, run_dir


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def test_resuming_mid_epoch_ends_with_the_weights_of_an_uninterrupted_run(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path
) -> None:
    base = settings(multi30k_root, cache_dir)
    whole, whole_dir = run(tmp_path, "whole", [*base, "trainer.max_steps=16"])
    _, first_dir = run(tmp_path, "first", [*base, "trainer.max_steps=7"])
    resume = f"resume={first_dir / 'checkpoints' / 'last.ckpt'}"
    second, second_dir = run(tmp_path, "second", [*base, "trainer.max_steps=16", resume])

    batches = [record["index"] for record in recorded(whole_dir)]
    per_epoch = sum(1 for record in recorded(whole_dir) if record["epoch"] == 0)
    assert 7 < per_epoch < 16  # step 7 is inside the first epoch and the run crosses into the second
    # the resumed run continues with the eighth batch and sees exactly the rest
    assert [record["index"] for record in recorded(first_dir)] == batches[:7]
    assert [record["index"] for record in recorded(second_dir)] == batches[7:]
    assert second["steps"] == whole["steps"] == 16 and second["resumed_from"].endswith("last.ckpt")
    expected, actual = weights(whole_dir), weights(second_dir)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_a_run_folder_with_a_last_checkpoint_continues_from_it(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path
) -> None:
    """What a requeued SLURM job does: the same command, the same folder, no resume key."""
    base = settings(multi30k_root, cache_dir)
    _, run_dir = run(tmp_path, "run", [*base, "trainer.max_steps=5"])
    again, _ = run(tmp_path, "run", [*base, "trainer.max_steps=9"])
    steps = [record["step"] for record in recorded(run_dir)]
    assert steps == list(range(9))  # no step twice, none left out
    assert again["resumed_from"] == str(run_dir / "checkpoints" / "last.ckpt") and again["steps"] == 9
