"""A steady-state training step never makes the host wait for the device (issue 31): over real optimizer
steps of a real run, every read of a tensor's value on the host (``item``, ``tolist``, ``bool()`` ...) and
every copy of a host value to the device (``torch.tensor(..., device=...)``) is counted, and only the
steps whose metrics reach the loggers may have any."""

from __future__ import annotations

import functools
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from aiayn.config.compose import compose_run_config
from aiayn.experiments.run import train
from helpers.runs import resumable_run

# Each way Python code gets a tensor's value onto the host; on a GPU each waits for the device.
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
# The functions that copy Python or NumPy values to the device they are given; on a GPU the host waits
# for such a copy (from pageable memory) and for all the work queued before it.
COPIES = ("tensor", "as_tensor")
STEPS, LOG_EVERY = 12, 4


class HostData(torch.Tensor):
    """A tensor made from a NumPy array, and whatever is computed from it alone: data that lives on the
    host in any run (the collator's sentence lengths, which the throughput callback sums), whose reads
    make nothing wait. ``torch.Tensor``'s own ``__torch_function__`` keeps the subclass through every op."""


class HostSyncs(pl.Callback):
    """Counts the host reads and copies made during each optimizer step: from the start of its batch to
    the start of the next (Lightning flushes the step's metrics to the loggers after the batch ends), not
    during validations or once training ends."""

    def __init__(self) -> None:
        self.by_step: Counter[int] = Counter()
        self.where: dict[int, list[str]] = {}
        self.step: int | None = None  # the optimizer step in progress, while counting

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.step = trainer.global_step + 1

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = None

    def record(self, what: str) -> None:
        if self.step is not None:
            self.by_step[self.step] += 1
            caller = traceback.extract_stack(limit=3)[0]  # above: the counting wrapper, then this
            self.where.setdefault(self.step, []).append(f"{what} at {caller.filename}:{caller.lineno}")


@contextmanager
def counted_syncs(syncs: HostSyncs, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Patches each of :data:`READS` on ``torch.Tensor`` and of :data:`COPIES` in ``torch`` with a wrapper
    that reports to ``syncs``, and makes ``torch.from_numpy`` return :class:`HostData` while a training
    batch runs."""
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, _counted_read(getattr(torch.Tensor, name), name, syncs))
    for name in COPIES:
        monkeypatch.setattr(torch, name, _counted_copy(getattr(torch, name), name, syncs))
    from_numpy = torch.from_numpy

    def host_data(array: Any) -> torch.Tensor:  # only while counting: checkpoints hold plain tensors
        tensor = from_numpy(array)
        return tensor.as_subclass(HostData) if syncs.step is not None else tensor

    monkeypatch.setattr(torch, "from_numpy", host_data)
    yield
    monkeypatch.undo()


def _counted_read(original: Callable[..., Any], name: str, syncs: HostSyncs) -> Callable[..., Any]:
    @functools.wraps(original)
    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self, HostData):
            syncs.record(name)
        return original(self, *args, **kwargs)

    return counted


def _counted_copy(original: Callable[..., Any], name: str, syncs: HostSyncs) -> Callable[..., Any]:
    @functools.wraps(original)
    def counted(data: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
            syncs.record(f"torch.{name}(..., device=)")
        return original(data, *args, **kwargs)

    return counted


CLIPPED = (
    "trainer.gradient_clip_val=0.5",
    "cpu_bf16=true",
)  # clipping under autocast, which Lightning's refuses to fused Adam


@pytest.mark.slow
@pytest.mark.parametrize(
    ("packed", "more"), [(False, ()), (True, ()), (False, CLIPPED)], ids=["padded", "packed attention", "clipped bf16"]
)
def test_training_steps_make_the_host_wait_for_the_device_only_when_their_metrics_are_logged(
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    packed: bool,
    more: tuple[str, ...],
) -> None:
    # One epoch (the corpus's 500 pairs) holds the steps; a validation after the last one only. The
    # progress bar shows the loss and tokens/s (read when they are logged). With packed attention the
    # nested sequences' layout comes with the batch: a nested tensor that had to find its shortest
    # sequence would read its offsets. Clipped gradients under bf16 autocast keep Adam fused, which takes
    # the non-finite guard's flag on the device (an unfused one would have the host decide every step).
    extra = (
        f"trainer.max_steps={STEPS}", f"checkpoint.every_steps={STEPS}", "decoding.max_len_offset=3", "progress=rich",
        f"model.packed_attention={str(packed).lower()}", *more,
    )  # fmt: skip
    overrides = resumable_run(corpus_root, cache_dir, *extra, pairs=500, eval_pairs=4, log_every=LOG_EVERY)
    cfg = compose_run_config(overrides)
    syncs = HostSyncs()
    with counted_syncs(syncs, monkeypatch):
        results = train(cfg, tmp_path / "run", overrides, callbacks=[syncs])
    assert results["steps"] == STEPS and results["skipped_steps"] == 0
    logged = {step for step in range(1, STEPS + 1) if step % LOG_EVERY == 0}
    unlogged = {step: syncs.where[step] for step in syncs.by_step if step not in logged}
    assert unlogged == {}, f"host syncs at steps whose metrics are not logged: {unlogged}"
    # The counter sees them: the logging steps read the logged values (the loss, the gradient norm ...).
    assert all(syncs.by_step[step] > 0 for step in logged), syncs.by_step
