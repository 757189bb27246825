"""A run on batches of few shapes (data.batch_shapes), with workers sized from the machine, stopped
mid-epoch and resumed, ends exactly where an uninterrupted one ends."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aiayn.config.compose import compose_run_config
from aiayn.data.sampler import ROWS_MULTIPLE
from aiayn.experiments.run import train
from helpers.batch_recorder import BatchRecorder, recorded
from helpers.runs import resumable_run

pytestmark = pytest.mark.slow


def run(run_dir: Path, overrides: list[str]) -> dict:
    return train(compose_run_config(overrides), run_dir, overrides, callbacks=[BatchRecorder(str(run_dir))])


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def test_a_bucketed_run_resumed_mid_epoch_ends_as_an_uninterrupted_one(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path
) -> None:
    base = resumable_run(multi30k_root, cache_dir, "data.batch_shapes=4")
    whole = run(tmp_path / "whole", [*base, "trainer.max_steps=16"])
    records = recorded(tmp_path / "whole")
    # rows: a multiple of 8, or fewer where 500 tokens hold fewer of the longest pairs (and the short batch)
    sizes = {len(record["index"]) for record in records}
    assert len(sizes) <= 4 + 1 and all(size % ROWS_MULTIPLE == 0 or size < ROWS_MULTIPLE for size in sizes)
    # the first part in worker processes as many as the machine gives (null), prefetching 2 each
    first = [*base, "data.num_workers=null", "data.prefetch_factor=2", "trainer.max_steps=7"]
    run(tmp_path / "first", first)
    resume = f"resume={tmp_path / 'first' / 'checkpoints' / 'last.ckpt'}"
    second = run(tmp_path / "second", [*base, "trainer.max_steps=16", resume])
    done = recorded(tmp_path / "first")
    batches = [record["index"] for record in records]
    assert [record["index"] for record in done] == batches[: len(done)]
    assert [record["index"] for record in recorded(tmp_path / "second")] == batches[len(done) :]
    assert second["steps"] == whole["steps"] == 16 and second["train_tokens"] == whole["train_tokens"]
    expected, actual = weights(tmp_path / "whole"), weights(tmp_path / "second")
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
