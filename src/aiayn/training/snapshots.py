"""Weights-only snapshots of a training run, taken off the step path: the step checkpoints kept for the
average a run ends with (§6.1) every ``checkpoint.average_every`` steps.

The weights are copied into host memory (:class:`HostCopy`, reused from one snapshot to the next) while
the next step's forward and backward passes run, and a background thread (:class:`SnapshotWriter`) writes
them through the run's checkpoint input/output, atomically, then deletes the snapshot each one displaces,
in the order they were asked for. On a GPU the training thread enqueues the copies into pinned memory on a
stream of their own, and the next optimizer step waits for them on the device; on the CPU the background
thread copies, and the next optimizer step waits for that copy (:meth:`SnapshotWriter.hold_weights`), which
is done by then unless the forward and backward passes took less time than copying the weights.

The writer's errors reach the training thread (:meth:`SnapshotWriter.check`, :meth:`SnapshotWriter.flush`),
and after one it writes and deletes nothing more: a snapshot that failed leaves the older ones in place.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO

log = logging.getLogger(__name__)

SLOTS = 2  # host copies at most: one being written while the next snapshot is taken
_ALIGN = 64  # elements: each tensor's copy starts on a cache line (and a 256-byte boundary for fp32)


def _key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What makes two entries of a state dict one tensor (the tied embeddings and output matrix, §3.4)."""
    return tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.dtype, tensor.shape


@dataclass(frozen=True)
class Layout:
    """A state dict's entries as distinct tensors: ``places[i]`` is the index among ``distinct`` of the
    ``i``-th entry's tensor; ``signature`` is what host memory for a copy of it must match."""

    distinct: list[torch.Tensor]
    places: list[int]
    signature: tuple[Any, ...]

    @classmethod
    def of(cls, weights: dict[str, torch.Tensor]) -> Layout:
        index: dict[tuple[Any, ...], int] = {}
        distinct: list[torch.Tensor] = []
        places = []
        for tensor in weights.values():
            key = _key(tensor)
            if key not in index:
                index[key] = len(distinct)
                distinct.append(tensor)
            places.append(index[key])
        shapes = tuple((tensor.device, tensor.dtype, tensor.shape) for tensor in distinct)
        return cls(distinct, places, (tuple(weights), tuple(places), shapes))


class HostCopy:
    """Host memory for one copy of a state dict's tensors: one flat buffer per dtype (pinned when the
    tensors are on a GPU, so that copies into it need not wait for the device), each tensor a view of it.
    Entries that share a tensor share its copy, so the file holds it once."""

    def __init__(self, layout: Layout) -> None:
        self.signature = layout.signature
        self.names, self.places = layout.signature[0], layout.places
        sizes: dict[torch.dtype, int] = {}
        offsets = []
        for tensor in layout.distinct:
            start = -(-sizes.get(tensor.dtype, 0) // _ALIGN) * _ALIGN
            offsets.append(start)
            sizes[tensor.dtype] = start + tensor.numel()
        pinned = any(tensor.is_cuda for tensor in layout.distinct)
        flat = {dtype: torch.empty(size, dtype=dtype, pin_memory=pinned) for dtype, size in sizes.items()}
        self.copies = [
            flat[tensor.dtype][start : start + tensor.numel()].view(tensor.shape)
            for tensor, start in zip(layout.distinct, offsets, strict=True)
        ]
        self.free = threading.Event()  # set while no write in the writer's queue uses this memory
        self.free.set()

    def fill(self, layout: Layout, non_blocking: bool) -> dict[str, torch.Tensor]:
        """The tensors of ``layout`` (this memory's) copied here: the state dict of the copies. With
        ``non_blocking``, copies from a GPU are only enqueued on the current stream."""
        for source, copy in zip(layout.distinct, self.copies, strict=True):
            copy.copy_(source.detach(), non_blocking=non_blocking and source.is_cuda)
        return {name: self.copies[place] for name, place in zip(self.names, self.places, strict=True)}


@dataclass
class _Job:
    """A file to write (``checkpoint`` at ``path``) or, without a checkpoint, to delete. A snapshot's weights
    are in ``memory``, copied from ``layout``'s tensors: on the CPU by the writer (then ``copied`` is set),
    on a GPU on the writer's stream before ``ready``."""

    path: Path
    checkpoint: dict[str, Any] | None = None
    layout: Layout | None = None  # also keeps the copies' sources alive until they are done
    memory: HostCopy | None = None
    copied: threading.Event | None = None
    ready: torch.cuda.Event | None = None


class SnapshotWriter:
    """Takes weights-only snapshots and writes them with ``io`` on a thread of its own. Every method is
    the training thread's."""

    def __init__(self, io: CheckpointIO) -> None:
        self.io = io
        self.written = 0  # files written so far
        self.held_s = 0.0  # seconds optimizer steps waited for the copy of a snapshot (on the CPU)
        self.waited_s = 0.0  # seconds snapshots waited for host memory that a write still used
        self._memory: list[HostCopy] = []  # least recently used first
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stream: torch.cuda.Stream | None = None
        self._copying: threading.Event | None = None  # the newest snapshot's copy by the writer (CPU)
        self._copied_on: tuple[torch.device, torch.cuda.Event] | None = None  # its copies' end on a GPU

    def save(self, path: Path, entries: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
        """Write ``entries`` with a copy of ``weights`` (a state dict) as its ``state_dict`` to ``path``,
        later. The weights must not change before :meth:`hold_weights`."""
        self.check()
        layout = Layout.of(weights)
        memory = self._free_memory(layout)
        memory.free.clear()
        device = next((tensor.device for tensor in layout.distinct if tensor.is_cuda), None)
        if device is None:
            self._copying = threading.Event()
            self._submit(_Job(path, dict(entries), layout, memory, copied=self._copying))
            return
        self._stream = self._stream or torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))  # the weights of the step just taken
        with torch.cuda.stream(self._stream):
            copies = memory.fill(layout, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        self._copied_on = device, ready
        self._submit(_Job(path, {**entries, "state_dict": copies}, layout, memory, ready=ready))

    def reserve(self, weights: dict[str, torch.Tensor]) -> None:
        """Allocate the host memory for snapshots of ``weights`` now (pinning memory takes long), not at the
        first snapshot."""
        self._free_memory(Layout.of(weights))

    def remove(self, path: Path) -> None:
        """Delete ``path`` with ``io``, after every write asked for before."""
        self.check()
        self._submit(_Job(path))

    def hold_weights(self) -> None:
        """Before the weights change (the next optimizer step): wait for the newest snapshot's copy, on the
        device for a GPU's weights (the host goes on), else here."""
        if self._copied_on is not None:
            device, copied = self._copied_on
            torch.cuda.current_stream(device).wait_event(copied)
            self._copied_on = None
        if self._copying is not None:
            start = time.perf_counter()
            self._copying.wait()
            self.held_s += time.perf_counter() - start
            self._copying = None

    def check(self) -> None:
        """Raise the error that stopped the writer, if one did (once)."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def flush(self) -> None:
        """Wait until everything asked for is written or deleted; raise the writer's error, if any."""
        if self._thread is not None:
            self._jobs.join()
        self.check()

    def close(self) -> None:
        """:meth:`flush`, and end the thread (the next snapshot starts another); frees the host memory."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        self._memory.clear()
        self._copying = self._copied_on = None
        self.check()

    def _free_memory(self, layout: Layout) -> HostCopy:
        """Host memory for a copy of ``layout``'s tensors that no queued write uses: a free one, a new one
        (up to :data:`SLOTS`), or the one the oldest write uses, once that is written."""
        self._memory = [m for m in self._memory if m.signature == layout.signature or not m.free.is_set()]
        memory = next((m for m in self._memory if m.free.is_set()), None)
        if memory is None and len(self._memory) >= SLOTS:
            memory = self._memory[0]
            start = time.perf_counter()
            memory.free.wait()
            if not self.waited_s:
                log.warning(
                    "the training waits for step checkpoints to be written: writing one takes longer than "
                    "checkpoint.average_every steps take to train"
                )
            self.waited_s += time.perf_counter() - start
            self.check()
            if memory.signature != layout.signature:
                self._memory.remove(memory)
                memory = None
        if memory is None:
            memory = HostCopy(layout)
        else:
            self._memory.remove(memory)
        self._memory.append(memory)
        return memory

    def _submit(self, job: _Job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="aiayn-snapshot-writer", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self._error is None:  # after a failure, nothing more: the older files stay
                    self._run(job)
            except BaseException as error:  # handed to the training thread (check, flush)
                self._error = error
            finally:
                if job.copied is not None:
                    job.copied.set()
                if job.memory is not None:
                    job.memory.free.set()
                job.layout = None
                self._jobs.task_done()
        self._jobs.task_done()

    def _run(self, job: _Job) -> None:
        if job.checkpoint is None:
            self.io.remove_checkpoint(job.path)
            return
        if job.copied is not None and job.memory is not None and job.layout is not None:
            job.checkpoint["state_dict"] = job.memory.fill(job.layout, non_blocking=False)
            job.copied.set()  # the optimizer step may change the weights now
        if job.ready is not None:
            job.ready.synchronize()
        self.io.save_checkpoint(job.checkpoint, job.path)
        self.written += 1
