"""Weights-only snapshots for averaging (``checkpoint.average_every``), written off the step path: each holds
the weights of its step even though the next step changes them, loads through the bounded
``weights_only`` path, averages and translates as any checkpoint; the writer deletes a displaced snapshot
only after its successor is written, stops at its first error and raises it on the training thread; and
every checkpoint that names a snapshot (``last.ckpt`` at a validation or a preemption) is written after it."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

import aiayn.training.checkpoint_io as checkpoint_io
from aiayn.cli.average import main as average_main
from aiayn.config.compose import compose_run_config
from aiayn.errors import CheckpointError
from aiayn.experiments.run import train
from aiayn.files import atomic_write
from aiayn.model import Transformer, TransformerConfig
from aiayn.training.callbacks.ema import EVALUATION_KEYS
from aiayn.training.callbacks.preemption import Preempted
from aiayn.training.checkpoint_io import RunCheckpointIO
from aiayn.training.checkpoints import (
    RUN_KEY,
    check_resumable,
    load_checkpoint,
    load_model,
    save_checkpoint,
    step_checkpoints,
)
from aiayn.training.snapshots import SnapshotWriter
from helpers.runs import smoke_run

FAST = ("decoding=greedy", "decoding.max_len_offset=3")
STEP_TRACKER = "ModelCheckpoint{'monitor': 'step'"  # the beginning of the step checkpoints' state key


def tied_model() -> Transformer:
    """A model whose embeddings and output projection are one matrix (§3.4)."""
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=50, n_layers=1, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8)
    return Transformer(cfg)


def test_a_snapshot_holds_its_steps_weights_though_the_next_step_changes_them(tmp_path: Path) -> None:
    model = tied_model()
    weights = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    before = {name: tensor.clone() for name, tensor in weights.items()}
    writer = SnapshotWriter(RunCheckpointIO(tmp_path))
    writer.save(tmp_path / "step0000002.ckpt", {"global_step": 2}, weights)
    writer.hold_weights()  # the optimizer step may change them now
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    writer.close()

    loaded = load_checkpoint(tmp_path / "step0000002.ckpt")  # the bounded, weights_only load
    assert loaded["global_step"] == 2 and loaded["state_dict"].keys() == before.keys()
    for name, tensor in before.items():
        torch.testing.assert_close(loaded["state_dict"][name], tensor, rtol=0, atol=0)
    tied = [loaded["state_dict"][f"model.{name}_embed.weight"] for name in ("src", "tgt")]
    tied.append(loaded["state_dict"]["model.output_proj.weight"])
    assert len({tensor.data_ptr() for tensor in tied}) == 1  # stored once, as the model holds it
    assert writer.written == 1


class Recording(RunCheckpointIO):
    """The run's checkpoint input/output that records what it writes and deletes, in order, failing the
    writes of ``fail``."""

    def __init__(self, folder: Path, fail: str = "") -> None:
        super().__init__(folder)
        self.done: list[tuple[str, str]] = []
        self.fail = fail

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if Path(path).name == self.fail:
            raise OSError(28, "No space left on device")
        super().save_checkpoint(checkpoint, path, storage_options)
        self.done.append(("save", Path(path).name))

    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(path)
        self.done.append(("remove", Path(path).name))


def test_a_displaced_snapshot_is_deleted_after_its_successor_is_written(tmp_path: Path) -> None:
    weights = {"model.weight": torch.randn(1000, 100)}
    io = Recording(tmp_path)
    writer = SnapshotWriter(io)
    for step in (2, 4, 6):
        writer.save(tmp_path / f"step{step:07d}.ckpt", {"global_step": step}, weights)
        if step > 2:
            writer.remove(tmp_path / f"step{step - 2:07d}.ckpt")
        writer.hold_weights()
    writer.flush()
    assert io.done == [
        ("save", "step0000002.ckpt"),
        ("save", "step0000004.ckpt"),
        ("remove", "step0000002.ckpt"),
        ("save", "step0000006.ckpt"),
        ("remove", "step0000004.ckpt"),
    ]
    assert [path.name for path in step_checkpoints(tmp_path)] == ["step0000006.ckpt"]


def test_a_failed_write_stops_the_writer_and_is_raised_on_the_training_thread(tmp_path: Path) -> None:
    weights = {"model.weight": torch.randn(10, 10)}
    io = Recording(tmp_path, fail="step0000004.ckpt")
    writer = SnapshotWriter(io)
    writer.save(tmp_path / "step0000002.ckpt", {"global_step": 2}, weights)
    writer.save(tmp_path / "step0000004.ckpt", {"global_step": 4}, weights)
    writer.remove(tmp_path / "step0000002.ckpt")  # displaced by the write that fails: kept
    writer.hold_weights()  # a failed copy still lets the step go on
    with pytest.raises(OSError, match="No space left on device"):
        writer.flush()
    writer.close()  # raised once: closing after it is quiet
    assert io.done == [("save", "step0000002.ckpt")]
    assert [path.name for path in tmp_path.iterdir()] == ["step0000002.ckpt"]


def test_a_snapshot_averages_with_whole_checkpoints_and_translates(smoke_run_dir: Path, tmp_path: Path) -> None:
    """aiayn-average over a whole checkpoint of a validation and a weights-only snapshot of another gives
    what it gives over the two whole checkpoints; the snapshot alone loads as a model."""
    folder = smoke_run_dir / "checkpoints"
    whole = load_checkpoint(folder / "step0000012.ckpt")
    writer = SnapshotWriter(RunCheckpointIO(tmp_path))
    entries = {key: whole[key] for key in EVALUATION_KEYS if key in whole}
    writer.save(tmp_path / "step0000012.ckpt", entries, whole["state_dict"])
    writer.close()
    save_checkpoint(load_checkpoint(folder / "step0000006.ckpt"), tmp_path / "step0000006.ckpt")

    average_main([str(tmp_path), "--last", "2", "-o", str(tmp_path / "mixed.ckpt")])
    average_main([str(folder / "step0000006.ckpt"), str(folder / "step0000012.ckpt"), "-o", str(tmp_path / "w.ckpt")])
    mixed, wholes = load_checkpoint(tmp_path / "mixed.ckpt"), load_checkpoint(tmp_path / "w.ckpt")
    assert mixed["state_dict"].keys() == wholes["state_dict"].keys()
    for name, tensor in wholes["state_dict"].items():
        torch.testing.assert_close(mixed["state_dict"][name], tensor, rtol=0, atol=0)
    model, tokenizer, config = load_model(tmp_path / "step0000012.ckpt")
    assert tokenizer.vocab_size == model.cfg.vocab_size and config == whole[RUN_KEY]["config"]


class SlowSnapshots:
    """The run's checkpoint writes, with each step checkpoint's taking ``delay`` seconds longer, and a record
    of whether the files ``last.ckpt``'s step tracker names were on disk when it was written."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, delay: float) -> None:
        self.named: list[tuple[int, list[str], bool]] = []  # step, tracked files, all on disk
        self.writers: set[str] = set()  # threads that wrote step checkpoints
        real = checkpoint_io.save_checkpoint

        def save(checkpoint: dict[str, Any], path: Path) -> None:
            if path.name.startswith("step"):
                self.writers.add(threading.current_thread().name)
                time.sleep(delay)
            if path.name == "last.ckpt":
                tracker = next(v for k, v in checkpoint["callbacks"].items() if k.startswith(STEP_TRACKER))
                tracked = sorted(tracker["best_k_models"])
                on_disk = all(Path(file).is_file() for file in tracked)
                self.named.append((checkpoint["global_step"], [Path(file).name for file in tracked], on_disk))
            real(checkpoint, path)

        monkeypatch.setattr(checkpoint_io, "save_checkpoint", save)


class SignalAt(pl.Callback):
    """Sends this process ``signum`` after optimizer step ``step``, as a scheduler would."""

    def __init__(self, step: int, signum: int = signal.SIGTERM) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.mark.slow
def test_a_preempted_run_names_only_written_snapshots_and_its_continuation_averages_them(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = SlowSnapshots(monkeypatch, delay=0.5)
    every = ("checkpoint.average_every=2", "checkpoint.keep_last=3", "checkpoint.average_last=3")
    overrides = smoke_run(corpus_root, cache_dir, *FAST, *every)
    with pytest.raises(Preempted):
        train(compose_run_config(overrides), tmp_path, overrides, callbacks=[SignalAt(4)])
    assert slow.named == [(4, ["step0000002.ckpt", "step0000004.ckpt"], True)]  # saved after the snapshot

    results = train(compose_run_config(overrides), tmp_path, overrides)  # continued from last.ckpt
    assert results["resumed_from"] and results["steps"] == 12
    assert [step for step, _, _ in slow.named] == [4, 6, 12, 12]  # validations at 6 and 12; after fit
    assert all(on_disk for _, _, on_disk in slow.named)
    assert slow.writers == {"aiayn-snapshot-writer"}  # never the training thread
    assert results["averaged_checkpoints"] == ["step0000008.ckpt", "step0000010.ckpt", "step0000012.ckpt"]
    assert [path.name for path in step_checkpoints(tmp_path)] == results["averaged_checkpoints"]
    for path in step_checkpoints(tmp_path):
        assert set(load_checkpoint(path)) == {*EVALUATION_KEYS, "state_dict"}


def test_a_failed_snapshot_ends_the_run_and_keeps_the_older_ones(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = checkpoint_io.save_checkpoint

    def disk_full_at_step_6(checkpoint: dict[str, Any], path: Path) -> None:
        if path.name != "step0000006.ckpt":
            real(checkpoint, path)
            return

        def half(file: Any) -> None:
            file.write(b"PK\x03\x04 half a checkpoint")
            raise OSError(28, "No space left on device")

        atomic_write(path, half)

    monkeypatch.setattr(checkpoint_io, "save_checkpoint", disk_full_at_step_6)
    every = ("checkpoint.average_every=2", "checkpoint.keep_last=2", "checkpoint.average_last=2")
    overrides = smoke_run(corpus_root, cache_dir, *FAST, *every)
    with pytest.raises(OSError, match="No space left on device"):
        train(compose_run_config(overrides), tmp_path, overrides)
    folder = tmp_path / "checkpoints"
    assert sorted(path.name for path in folder.iterdir()) == ["step0000002.ckpt", "step0000004.ckpt"]
    for step in (2, 4):
        assert load_checkpoint(folder / f"step{step:07d}.ckpt")["global_step"] == step


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_snapshot_is_copied_on_its_own_stream_into_pinned_memory(tmp_path: Path) -> None:
    model = tied_model().cuda()
    weights = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    before = {name: tensor.cpu() for name, tensor in weights.items()}
    writer = SnapshotWriter(RunCheckpointIO(tmp_path))
    writer.save(tmp_path / "step0000002.ckpt", {"global_step": 2}, weights)
    assert all(copy.is_pinned() for copy in writer._memory[0].copies)
    writer.hold_weights()  # the device's next work waits for the copies; the host goes on
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(-3.0).add_(1.0)
    writer.close()
    loaded = load_checkpoint(tmp_path / "step0000002.ckpt")
    for name, tensor in before.items():
        torch.testing.assert_close(loaded["state_dict"][name], tensor, rtol=0, atol=0)


def test_a_truncated_last_checkpoint_is_continued_from_best_not_from_a_snapshot(
    smoke_run_dir: Path, tmp_path: Path
) -> None:
    """The advice after an unreadable ``last.ckpt`` names a checkpoint with the training state: a snapshot,
    newer as it is, cannot be continued from."""
    folder = smoke_run_dir / "checkpoints"
    whole = load_checkpoint(folder / "step0000012.ckpt")
    writer = SnapshotWriter(RunCheckpointIO(tmp_path))
    writer.save(tmp_path / "step0000012.ckpt", {key: whole[key] for key in EVALUATION_KEYS}, whole["state_dict"])
    writer.close()
    save_checkpoint(load_checkpoint(folder / "best.ckpt"), tmp_path / "best.ckpt")
    last = (folder / "last.ckpt").read_bytes()
    (tmp_path / "last.ckpt").write_bytes(last[: len(last) // 2])

    with pytest.raises(CheckpointError) as refused:
        check_resumable(tmp_path / "last.ckpt")
    best = tmp_path / "best.ckpt"
    assert str(refused.value).endswith(
        f"the newest readable checkpoint of the run is {best}: continue from it with resume={best}"
    )
    with pytest.raises(CheckpointError, match="has no training state"):
        check_resumable(tmp_path / "step0000012.ckpt")
